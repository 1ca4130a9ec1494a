"""backends/cpu"""
