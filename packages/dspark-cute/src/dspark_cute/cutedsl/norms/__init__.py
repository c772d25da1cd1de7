"""The RMSNorm kernels: ``rms`` (the traced norm pieces they share),
``row_norm`` (``RowNorm``), ``boundary`` (``DraftBoundary``: post-norm, gated
residual, pre-norm) and ``context_norms`` (``ContextNorms``)."""
