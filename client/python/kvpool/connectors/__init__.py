"""Engine connectors: vLLM KV connector, SGLang HiCache backend, remote attention."""
