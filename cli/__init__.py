"""``markbase``: the command line (serve, chat, models, bench, quantize)."""
