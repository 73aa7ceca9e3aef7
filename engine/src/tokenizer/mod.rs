//! Tokenizers and chat templates from GGUF metadata.
