"""Routing an engine recorded itself, written as a moetrace v1 trace (``moetrace import``): the routing vLLM and SGLang
return per request (``returned``), SGLang's expert distribution recorder dumps (``sglang_recorder``), and what both
share to write a trace (``trace``)."""
