"""SGLang generation servers behind Cadence's engine interface (see engine.SGLangEngine)."""
