"""One recording, driver side: ``record`` plans the run and starts one engine per k (``engine``), the drafter
checkpoint is resolved and checked (``drafters``), the built-in prompts (``prompts``) and NVML sampling
(``telemetry``). Inside vLLM, ``moetrace.hooks`` captures the rows and hands them to the writer process
(``moetrace.writer``), which writes the trace (``moetrace.trace``)."""
