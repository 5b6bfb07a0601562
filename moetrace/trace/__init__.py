"""The trace contract, the one thing recording and analysis share: the schema and its versions (``schema``), the
typed manifest (``manifest``), the Parquet files and the engine-to-writer step message (``files``), and the reader
(``reader``). The hooks and the writer process write through it; analysis and the report read through it."""
