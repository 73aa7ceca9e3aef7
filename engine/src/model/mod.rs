//! Architectures: hyper-parameters from metadata, and the model generator.
