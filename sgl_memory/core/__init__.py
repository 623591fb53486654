"""The core floor: what the mechanisms share; imports nothing else of sgl-memory and no SGLang."""
