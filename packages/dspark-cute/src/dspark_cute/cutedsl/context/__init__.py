"""The context K/V chain: ``store`` (``ContextKvStore``: K-norm, RoPE and the
cache insert) and ``chain`` (``ContextChain``: the context norms, the stock
K/V projection and the store)."""
