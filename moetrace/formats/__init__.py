"""Engine formats both ways. In (``moetrace import``): the routing vLLM and SGLang return per request
(``returned``) and SGLang's expert distribution recorder dumps (``sglang_recorder``), written as a moetrace trace
(``imported_trace``). Out (``moetrace export``): the decision and the expert load in vLLM's and SGLang's formats
(``export``)."""
