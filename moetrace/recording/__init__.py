"""One recording, driver side: ``record`` plans the run and starts one engine per k (``engine``), the drafter
checkpoint is resolved and checked (``drafters``), the built-in prompts (``prompts``), the host's facts
(``host``), NVML sampling (``telemetry``), and the writer process (``writer``) that drains the workers' shared
ring (``ring``) into Parquet. Inside vLLM, ``moetrace.hooks`` captures the rows."""
