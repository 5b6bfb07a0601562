"""The writer side of a recording: the ring the engine's workers share with the writer process (``ring``), that
process (``process``: steps out of the ring into the trace's Parquet files) and the live metrics it serves
(``metrics``)."""
