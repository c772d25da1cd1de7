"""The projections: ``skinny`` (the tensor-core main loops of 1 to 16 rows)
and ``gemv`` (``Gemv``: the one-token GEMV)."""
