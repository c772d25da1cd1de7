"""The numeric spec of the stock layers, as executable PyTorch."""
