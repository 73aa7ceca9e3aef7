//! Run time: the engine (flags and the one composition root), sequences and their step driver, sampling and
//! generation.

pub mod batch;
pub mod engine;
pub mod generate;
pub mod grammar;
pub mod sampling;
pub mod session;
pub mod sim;
