//! The `strata` binary as users run it: generate, inspect, experts, and `strata serve` through both APIs and its failure contract.
//!
//! One test binary per area (each links the engine once); each module is one former test file.

mod experts;
mod generate;
mod inspect;
mod serve_api;
mod serve_batch;
mod serve_common;
mod serve_failures;
mod serve_params;
mod serve_structured;
mod serve_tools;
mod sim_device;
