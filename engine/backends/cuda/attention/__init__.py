"""backends/cuda/attention"""
