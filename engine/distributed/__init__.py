"""One model over several ranks (tensor parallelism) with MLX's distributed backends.

Public face for the rest of the engine: ``TensorParallelGroup`` (rank 0's followers,
control channel and watchdog), ``LockstepRunner`` (rank 0's runner, which tells the
followers each op), ``RankLostError``.
"""

from engine.distributed.channel import RankLostError
from engine.distributed.launch import TensorParallelGroup
from engine.distributed.lockstep import LockstepRunner

__all__ = ["LockstepRunner", "RankLostError", "TensorParallelGroup"]
