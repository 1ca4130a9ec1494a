"""markbase engine: owns models, KV caches and the continuous batcher."""
