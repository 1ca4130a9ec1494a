"""How the decode step's linear layers multiply on a GPU, by the number of rows.

from engine import envs

MLX 0.32.4's CUDA matmuls are fast for one row but slow for the skinny products of
a batched decode step: docs/performance.md measured its bf16 products moving the
weights at 1.47 TB/s for 1 row and 0.8 TB/s for 8-128 rows, and its 4-bit
``quantized_matmul`` at 0.09-0.15 TB/s from 8 rows on (8b 4-bit at 32 rows: 104 ms
a step). The same product can be written in ways that reach other kernels:

- float: ``xwt`` = ``x @ w.T`` (what ``nn.Linear`` does), ``wxt`` = ``(w @ x.T).T``
  (the weight as the left operand: cuBLAS sees an N x K by K x B product);
- float: ``gemv`` = engine/backends/cuda/products/gemv.py's kernel (up to 8 rows a call, each call
  reading the weight once; no cuBLAS call, whose host cost dominates small batches);
- float: ``mma`` = engine/backends/cuda/products/mma.py's tensor-core kernel (one call for any rows, the
  weight read once per 32 rows; no cuBLAS call);
- quantized: ``qgemv`` = engine/backends/cuda/products/gemv.py's 4-bit kernel (same; 4-bit affine only);
  ``qmma`` = engine/backends/cuda/products/mma.py's 4-bit tensor-core kernel (the same);
  ``qstream`` = engine/backends/cuda/products/qstream.py's 1-row 4-bit kernel (loads through shared
  memory, the RMSNorm before it folded in where asked; other row counts go to ``qmma``);
  ``qgemm`` = engine/backends/cuda/products/qgemm.py's 4-bit kernel for many rows (x staged in shared
  memory; the plan's ``qgemm`` runs the SwiGLU gate/up and a wide output layer of
  4096+ inputs, the rest on ``qmma``: gpu_qgemm.takes);
  ``qmm`` = ``mx.quantized_matmul``; ``deq`` = dequantize the weight to
  the activations' dtype, then ``xwt`` (reads the 4-bit weight, writes and reads a
  bf16 copy: about 3x the bytes of a bf16 product, but at bf16 speed); ``deqwxt``;
  ``qmmk2``/``qmmk4`` = split-K: the input dim cut into 2/4 parts (kept as contiguous
  copies of the weight's column blocks, made when the plan names the form: extra
  memory), one ``qmm`` per part, summed. The parts are independent products, so
  MLX's CUDA graph may run them side by side: more thread blocks in flight for the
  skinny decode products (docs/performance.md; experimental).

A plan maps row counts to a formulation: ``"1:xwt,8:wxt"`` = ``xwt`` below 8 rows,
``wxt`` from 8 on. ``bench/gpu/matmul_rows.py`` measures every formulation per row
count on the machine and prints the winning plans; the defaults below are its
result on the H200 (see docs/performance.md). Environment: ``MARKBASE_GPU_FLOAT_PLAN``,
``MARKBASE_GPU_QUANT_PLAN``. Only the GPU decode step uses this; the CPU's products
go through BLAS and engine/backends/cpu/qgemm.py, which need ``x @ w.T`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import envs

FLOAT_FORMS = ("xwt", "wxt", "gemv", "mma")
QUANT_FORMS = ("qmm", "deq", "deqwxt", "qmmk2", "qmmk4", "qgemv", "qmma", "qstream", "qgemm")
# measured on the H200 (docs/performance.md): engine/backends/cuda/products/mma.py's
# tensor-core kernels from 2 to 32 rows (8b 4-bit B=8 630 -> 1,131-1,512 tok/s, B=32
# 1,373 -> 4,258-4,345; 1b bf16 B=8 1.5-1.7x, B=32 1.4-2.4x, with the residual adds
# and the SwiGLU folded into them). 4-bit: also at 1 row (GPU 5.9 -> 4.0 ms a step at
# 8b, 135 fewer kernels) and from 33 rows (one call; 4 row chunks measured 23 ms of
# GPU a step at 8b B=128 against qmm_sm80's 33). bf16: at 1 row MLX's gemv is at the
# bandwidth (8b: 5.0 ms a step, the kernel 7.5), from 33 rows cuBLAS reads the
# weight once where the kernel reads it once per 32 rows.
DEFAULT_FLOAT_PLAN = "1:xwt,2:mma,33:xwt"
# 1 row: engine/backends/cuda/products/qstream.py (8b 4-bit B=1 279 -> 307 tok/s in one run;
# a layer's 4 products 75.6 -> 65.2 us); from 33 rows the SwiGLU gate/up on
# engine/backends/cuda/products/qgemm.py (H100: 0.68-0.85x qmma's kernel time by CUPTI; 8b
# 4-bit B=128 +5-7% in one run), and an output layer of 4096+ inputs
# (8b 4-bit B=128 7,629 -> 8,111-8,168 tok/s); the other products stay on qmma
# (gpu_qgemm.takes)
DEFAULT_QUANT_PLAN = "1:qstream,2:qmma,33:qgemm"


@dataclass(frozen=True)
class Plan:
    steps: tuple[tuple[int, str], ...]  # (from this many rows, formulation), ascending

    def form(self, rows: int) -> str:
        chosen = self.steps[0][1]
        for start, form in self.steps:
            if rows >= start:
                chosen = form
        return chosen


def parse_plan(text: str, forms: tuple[str, ...]) -> Plan:
    """``"1:xwt,8:wxt"`` -> Plan; a clear error for anything else."""
    steps = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        start, sep, form = part.partition(":")
        if not sep or not start.isdigit() or form not in forms:
            raise ValueError(
                f"bad GPU matmul plan {text!r}: want 'ROWS:FORM,...' with FORM in {forms}"
            )
        steps.append((int(start), form))
    if not steps:
        raise ValueError(f"empty GPU matmul plan {text!r}")
    steps.sort()
    return Plan(tuple(steps))


_current: dict[str, Plan] = {}
# bumped whenever the plans change: the layers' cached routes (_Routes) follow
_generation = [0]


def float_plan() -> Plan:
    if "float" not in _current:
        text = envs.MARKBASE_GPU_FLOAT_PLAN
        _current["float"] = parse_plan(text, FLOAT_FORMS)
    return _current["float"]


def quant_plan() -> Plan:
    if "quant" not in _current:
        text = envs.MARKBASE_GPU_QUANT_PLAN
        _current["quant"] = parse_plan(text, QUANT_FORMS)
    return _current["quant"]


def set_plans(float_text: str | None = None, quant_text: str | None = None) -> None:
    """Replace the plans that layers built without an explicit plan follow from their
    next call on (benchmarks switch them between variants in one process)."""
    if float_text is not None:
        _current["float"] = parse_plan(float_text, FLOAT_FORMS)
    if quant_text is not None:
        _current["quant"] = parse_plan(quant_text, QUANT_FORMS)
    _generation[0] += 1


def reset_plans() -> None:
    """Forget set_plans() and read the environment again at the next call."""
    _current.clear()
    _generation[0] += 1


def uses(form: str) -> bool:
    """Whether the current float or quantized plan names ``form``."""
    return any(f == form for plan in (float_plan(), quant_plan()) for _, f in plan.steps)


def _rows(x) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


_checked: dict = {}


def _float_kernel_ok(form: str, dtype, w) -> bool:
    """Whether the custom kernel of ``form`` takes this product (remembered per shape:
    the check would run on every call of every layer otherwise)."""
    key = (form, dtype, w.dtype, w.shape)
    ok = _checked.get(key)
    if ok is None:
        from engine.backends.cuda.products import gemv as gpu_gemv
        from engine.backends.cuda.products import mma as gpu_mma

        if form == "mma":
            ok = gpu_mma.float_supported(dtype, w.dtype, w.shape[0], w.shape[-1])
        else:
            ok = gpu_gemv.float_supported(dtype, w.dtype, w.shape[-1])
        _checked[key] = ok
    return ok


def float_matmul(x, w, form: str):
    """``x @ w.T`` for x [..., K], w [N, K], written as ``form``."""
    if form in ("mma", "gemv"):
        from engine.backends.cuda.products import gemv as gpu_gemv
        from engine.backends.cuda.products import mma as gpu_mma

        module = gpu_mma if form == "mma" else gpu_gemv
        if _float_kernel_ok(form, x.dtype, w):
            if x.ndim == 2:  # the GPU step's [B, D]: no reshapes (each is host time)
                return module.matmul(x, w)
            lead = x.shape[:-1]
            y = module.matmul(x.reshape(-1, x.shape[-1]), w)
            return y.reshape(*lead, w.shape[0])
        form = "xwt"
    if form == "xwt":
        return x @ w.T
    lead = x.shape[:-1]
    y = (w @ x.reshape(-1, x.shape[-1]).T).T
    return y.reshape(*lead, w.shape[0])


class _Routes:
    """How this layer's 2-D products run, worked out once per (rows, dtype, form)
    and kept: the plan lookup, the kernel's support check, its template and launch
    geometry cost ~5 us of Python a call on this repo's CPU, more than MLX's own op
    (bench/gpu/wrapper_cost.py), and a decode step makes 4 products a layer."""

    _routes: dict
    _generation: int = -1

    def _route(self, x, residual: bool, glu: bool, norm: bool):
        if self._generation != _generation[0]:  # the plans changed (benchmarks)
            self._routes, self._generation = {}, _generation[0]
        key = (x.shape[0], x.dtype, residual, glu, norm)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._make_route(x, residual, glu, norm)
        return route

    def set_plan(self, plan: Plan | None) -> None:
        """Follow ``plan`` from the next call on (None: the global plan again); for
        benchmarks that time one layer's forms in turn."""
        self._plan, self._routes = plan, {}
        for _, form in self.plan.steps:
            if form.startswith("qmmk") and int(form[4:]) not in self._parts:
                self._split(int(form[4:]))

    def __call__(self, x):
        if x.ndim == 2:
            return self._route(x, False, False, False)(x, None, None)
        return self._call_form(x, self.plan.form(_rows(x)))

    def fused(self, x, residual=None, glu: bool = False, norm=None):
        """``residual + x @ w.T``, or with ``glu`` (w = [gate; up]) ``silu(x @ gate.T) *
        (x @ up.T)``; ``norm`` (an ``nn.RMSNorm``, not with ``residual``): x goes
        through it first. One kernel call (engine/backends/cuda/products/mma.py, engine/backends/cuda/products/qstream.py)
        when the plan sends these rows there (x [B, K], the 2-D decode step), else the
        same math as MLX ops. The norm goes inside only the 1-row kernel's call
        (engine/backends/cuda/products/qstream.py); before the other kernels it is a
        separate op (inside engine/backends/cuda/products/mma.py's, whose blocks each
        recompute it, the step's GPU time went up 45-60%: docs/performance.md)."""
        if x.ndim == 2:
            route = self._route(x, residual is not None, glu, norm is not None)
            return route(x, residual, norm)
        return _unfused(self, x, residual, glu, norm)

    def _make_route(self, x, residual: bool, glu: bool, norm: bool):
        """``route(x, residual, norm)`` for these rows: the kernel when the plan says
        so and it takes the shape, else MLX ops."""
        rows = x.shape[0]
        launch = self._launcher(x.dtype, rows, residual, glu, norm)
        if launch is None and norm:  # the norm as its own op, the rest as without it
            inner = self._make_route(x, residual, glu, False)
            return lambda x, r, nm: inner(nm(x), r, None)
        if launch is None:
            if residual or glu or norm:
                return lambda x, r, nm: _unfused(self, x, r, glu, nm)
            form = self.plan.form(rows)
            return lambda x, r, nm: self._call_form(x, form)
        arrays = self._kernel_arrays()

        def route(x, r, nm):
            inputs = [x, *arrays]
            if r is not None:
                inputs.append(r)
            if nm is not None:
                from engine.backends.cuda.products import mma as gpu_mma

                inputs += [nm.weight, gpu_mma.device_scalar(float(nm.eps))]
            return launch(inputs)

        return route


class GpuLinear(_Routes):
    """A float linear layer (no bias) that follows the float plan per call."""

    def __init__(self, weight, plan: Plan | None = None) -> None:
        self.weight = weight
        self._plan = plan
        self._routes = {}

    @property
    def plan(self) -> Plan:
        return self._plan or float_plan()

    def _call_form(self, x, form: str):
        return float_matmul(x, self.weight, form)

    def _kernel_arrays(self) -> list:
        return [self.weight]

    def _launcher(self, dtype, rows: int, residual: bool, glu: bool, norm: bool):
        if self.plan.form(rows) != "mma" or not _float_kernel_ok("mma", dtype, self.weight):
            return None
        if norm:  # the norm as its own op (_make_route)
            return None
        from engine.backends.cuda.products import mma as gpu_mma

        n, k = self.weight.shape
        return gpu_mma.launcher("float", dtype, rows, n, k, 0, residual, glu)


class GpuQuantizedLinear(_Routes):
    """A quantized linear layer (no bias) that follows the quantized plan per call."""

    def __init__(self, weight, scales, biases, group_size, bits, mode, plan=None) -> None:
        self.weight, self.scales, self.biases = weight, scales, biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self._plan = plan
        self._parts: dict[int, list] = {}
        self._ok: dict = {}
        self._routes = {}
        for _, form in self.plan.steps:
            if form.startswith("qmmk"):
                self._split(int(form[4:]))

    @property
    def plan(self) -> Plan:
        return self._plan or quant_plan()

    def _kernel_arrays(self) -> list:
        return [self.weight, self.scales, self.biases]

    def _launcher(self, dtype, rows: int, residual: bool, glu: bool, norm: bool):
        form = self.plan.form(rows)
        n, k = self.weight.shape[0], self.scales.shape[-1] * self.group_size
        if form == "qstream":
            if rows == 1 and self._kernel_ok("qstream", dtype):
                from engine.backends.cuda.products import qstream as gpu_qstream

                if norm and not gpu_qstream.takes_norm(n, glu):
                    return None
                return gpu_qstream.launcher(dtype, n, k, self.group_size, residual, glu, norm)
            form = "qmma"
        if form == "qgemm" and self._wgmma_takes(rows, dtype, n, k):
            if norm:  # as for qgemm: the norm as its own op (_make_route)
                return None
            from engine.backends.cuda.products import wgmma as gpu_wgmma

            return gpu_wgmma.launcher(dtype, rows, n, k, self.group_size, residual, glu)
        form = self._qgemm_or_qmma(form, rows, dtype, glu, k, residual)
        if form == "qgemm":
            if norm:  # not a form of this kernel: the norm as its own op (_make_route)
                return None
            from engine.backends.cuda.products import qgemm as gpu_qgemm

            return gpu_qgemm.launcher(dtype, rows, n, k, self.group_size, residual, glu)
        if form != "qmma" or not self._kernel_ok("qmma", dtype):
            return None
        if norm:  # the norm as its own op (_make_route)
            return None
        from engine.backends.cuda.products import mma as gpu_mma

        return gpu_mma.launcher("q4", dtype, rows, n, k, self.group_size, residual, glu)

    def _qgemm_or_qmma(self, form: str, rows: int, dtype, glu: bool, k: int, residual: bool) -> str:
        """``form``, except ``qgemm`` where its kernel does not take this layer or the
        product (``gpu_qgemm.takes``: the SwiGLU gate/up or a long output layer, with
        enough blocks): ``qmma``."""
        if form != "qgemm":
            return form
        from engine.backends.cuda.products import qgemm as gpu_qgemm

        m_tiles = self.weight.shape[0] // 16
        if gpu_qgemm.takes(rows, m_tiles, glu, k, residual) and self._kernel_ok("qgemm", dtype):
            return form
        return "qmma"

    def _wgmma_takes(self, rows: int, dtype, n: int, k: int) -> bool:
        """Whether engine/backends/cuda/products/wgmma.py runs the plan's ``qgemm`` rows of this layer: a
        shape it supports, and ``gpu_wgmma.takes`` (an sm_90 GPU, 65-128 rows by default,
        a launch without k-splits)."""
        from engine.backends.cuda.products import wgmma as gpu_wgmma

        return self._kernel_ok("wgmma", dtype) and gpu_wgmma.takes(rows, n, k)

    def _kernel_ok(self, form: str, dtype) -> bool:
        """Whether the custom kernel of ``form`` takes this layer (remembered per dtype)."""
        key = (form, dtype)
        ok = self._ok.get(key)
        if ok is None:
            from engine.backends.cuda.products import gemv as gpu_gemv
            from engine.backends.cuda.products import mma as gpu_mma
            from engine.backends.cuda.products import qgemm as gpu_qgemm
            from engine.backends.cuda.products import qstream as gpu_qstream

            n, k = self.weight.shape[0], self.scales.shape[-1] * self.group_size
            if form == "wgmma":
                from engine.backends.cuda.products import wgmma as gpu_wgmma

                ok = gpu_wgmma.supported(
                    dtype, n, k, self.bits, self.group_size, self.mode, self.biases
                )
            elif form == "qgemm":
                ok = gpu_qgemm.supported(
                    dtype, n, k, self.bits, self.group_size, self.mode, self.biases
                )
            elif form == "qstream":
                ok = gpu_qstream.supported(
                    dtype, 1, n, k, self.bits, self.group_size, self.mode, self.biases
                )
            else:
                module = gpu_mma if form == "qmma" else gpu_gemv
                ok = module.quant_supported(
                    dtype, n, k, self.bits, self.group_size, self.mode, self.biases
                )
            self._ok[key] = ok
        return ok

    def _split(self, n: int) -> list | None:
        """The weight's n column blocks (whole quantization groups), as contiguous
        copies: [(k0, k1, weight, scales, biases)], or None if K does not split."""
        if n in self._parts:
            return self._parts[n]
        import mlx.core as mx

        k = self.scales.shape[-1] * self.group_size
        groups = self.scales.shape[-1]
        if groups % n or self.bits not in (2, 4, 8) or self.mode != "affine":
            self._parts[n] = None
            return None
        per_word = 32 // self.bits
        parts = []
        for i in range(n):
            g0, g1 = i * groups // n, (i + 1) * groups // n
            k0, k1 = g0 * self.group_size, g1 * self.group_size
            w = mx.contiguous(self.weight[:, k0 // per_word : k1 // per_word])
            sc = mx.contiguous(self.scales[:, g0:g1])
            bi = None if self.biases is None else mx.contiguous(self.biases[:, g0:g1])
            parts.append((k0, k1, w, sc, bi))
        mx.eval([p[2:] for p in parts])
        self._parts[n] = parts
        assert k == parts[-1][1]
        return parts

    def _call_form(self, x, form: str):
        import mlx.core as mx

        # qstream: the [B, 1, K] path, not the decode step's; qgemm: a module's call is a
        # plain product, which the plan's qgemm leaves to qmma (gpu_qgemm.takes)
        if form in ("qstream", "qgemm"):
            form = "qmma"
        if form in ("qmma", "qgemv"):
            from engine.backends.cuda.products import gemv as gpu_gemv
            from engine.backends.cuda.products import mma as gpu_mma

            module = gpu_mma if form == "qmma" else gpu_gemv
            if self._kernel_ok(form, x.dtype):
                if x.ndim == 2:  # the GPU step's [B, D]: no reshapes (each is host time)
                    return module.quantized_matmul(
                        x, self.weight, self.scales, self.biases, self.group_size
                    )
                lead = x.shape[:-1]
                y = module.quantized_matmul(
                    x.reshape(-1, x.shape[-1]),
                    self.weight,
                    self.scales,
                    self.biases,
                    self.group_size,
                )
                return y.reshape(*lead, self.weight.shape[0])
            form = "qmm"
        if form.startswith("qmmk"):
            parts = self._split(int(form[4:]))
            if parts is None:
                form = "qmm"
            else:
                out = None
                for k0, k1, w, sc, bi in parts:
                    y = mx.quantized_matmul(
                        x[..., k0:k1],
                        w,
                        scales=sc,
                        biases=bi,
                        transpose=True,
                        group_size=self.group_size,
                        bits=self.bits,
                        mode=self.mode,
                    )
                    out = y if out is None else out + y
                return out
        if form == "qmm":
            return mx.quantized_matmul(
                x,
                self.weight,
                scales=self.scales,
                biases=self.biases,
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
        w = mx.dequantize(
            self.weight,
            self.scales,
            self.biases,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=x.dtype,
        )
        return float_matmul(x, w, "xwt" if form == "deq" else "wxt")


def _unfused(linear, x, residual, glu: bool, norm=None):
    import mlx.core as mx
    import mlx.nn as nn

    y = linear(x if norm is None else norm(x))
    if glu:
        g, u = mx.split(y, 2, axis=-1)
        y = nn.silu(g) * u
    return y if residual is None else residual + y


def for_module(linear):
    """The plan-following callable for an ``nn.Linear``/``nn.QuantizedLinear``
    without bias, or None (then the module is called as it is)."""
    import mlx.nn as nn

    from engine.backends.cuda import prefill as gpu_prefill

    if "bias" in linear:
        return None
    if type(linear) is nn.Linear:
        return GpuLinear(linear.weight)
    if gpu_prefill.is_plain_quantized(linear):
        return GpuQuantizedLinear(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            linear.group_size,
            linear.bits,
            getattr(linear, "mode", "affine"),
        )
    return None
