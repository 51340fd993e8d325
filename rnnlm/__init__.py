"""rnnlm: recurrent neural language models from scratch in NumPy/CuPy, trained on Spark."""
__version__ = "0.1.0"
