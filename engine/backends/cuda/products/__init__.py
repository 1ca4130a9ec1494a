"""backends/cuda/products"""
