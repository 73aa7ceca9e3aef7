//! `strata experts`: routing traces and the expert-cache simulator.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use strata_engine::experts::cache::Policy;
use strata_engine::experts::simulate::{SimConfig, belady_hits, simulate};
use strata_engine::experts::trace::{MAX_LOOKUPS, SynthRouting, Trace, geometry_error, synth_trace};

#[derive(Subcommand)]
pub enum ExpertsCommand {
    /// Replay a routing trace through the expert cache: hit rate per policy and slot count, beside Belady's
    /// optimal hit rate, and the bytes that would cross the link.
    Simulate(SimulateArgs),
    /// Write a decode routing trace with a chosen locality (default: the published Qwen3-30B-A3B figures).
    SynthTrace(SynthTraceArgs),
}

#[derive(Args)]
pub struct SimulateArgs {
    /// A routing trace (JSON Lines; `strata experts synth-trace` writes one).
    trace: PathBuf,
    /// Cache sizes in slots (one expert of one layer each), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    slots: Vec<usize>,
    /// Policies to compare, comma-separated (`profile` pins the trace's most used experts before it starts).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "lru,lfru")]
    policy: Vec<Policy>,
    /// At most this many uploads per layer per step; further misses are served around the cache.
    #[arg(long)]
    upload_cap: Option<u32>,
    /// A GGUF model whose per-expert bytes price the uploads (else uploads are counted, not priced).
    #[arg(long)]
    model: Option<String>,
}

#[derive(Args)]
pub struct SynthTraceArgs {
    /// Where to write the trace.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..))]
    layers: u32,
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    experts: u32,
    /// Experts per token (top-k).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    k: u32,
    /// Decode steps (one token each).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    tokens: u64,
    /// No locality: every pick uniform (how a random-weight model routes).
    #[arg(long, conflicts_with_all = ["reuse_next", "reuse_2_to_8", "zipf"])]
    random: bool,
    /// Probability that a pick repeats one of the previous token's experts.
    #[arg(long, value_parser = probability)]
    reuse_next: Option<f64>,
    /// Probability that a pick repeats an expert of one of the tokens 2 to 8 back.
    #[arg(long, value_parser = probability)]
    reuse_2_to_8: Option<f64>,
    /// Zipf exponent of the other picks over the experts (0: uniform).
    #[arg(long, default_value_t = 0.0, value_parser = exponent)]
    zipf: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("takes a probability from 0 to 1, not `{s}`")),
    }
}

fn exponent(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(z) if z.is_finite() && z >= 0.0 => Ok(z),
        _ => Err(format!("takes a finite exponent >= 0, not `{s}`")),
    }
}

pub fn run(cmd: ExpertsCommand) -> Result<()> {
    match cmd {
        ExpertsCommand::Simulate(a) => simulate_cmd(a),
        ExpertsCommand::SynthTrace(a) => synth_cmd(a),
    }
}

/// Bytes of one expert of one layer (its gate, up and down rows) in `model`, whose expert layers must be the
/// trace's: the model is loaded as the engine loads it (every tensor's shape checked), and its expert store's
/// bytes are divided over its layers and experts.
fn expert_bytes(model: &str, trace: &Trace) -> Result<u64> {
    let path = strata_engine::models::resolve(Some(model))?;
    let m = strata_engine::model::Model::load(&path)?;
    let h = trace.header;
    if !m.hp.is_moe() {
        bail!("{}: not a mixture-of-experts model (no expert_count)", path.display());
    }
    if (m.hp.n_layer, m.hp.n_expert, m.hp.n_expert_used) != (h.n_layer, h.n_expert, h.k) {
        bail!(
            "{}: {} layers of {} experts, top-{}, but the trace is of {} layers of {} experts, top-{}",
            path.display(),
            m.hp.n_layer,
            m.hp.n_expert,
            m.hp.n_expert_used,
            h.n_layer,
            h.n_expert,
            h.k
        );
    }
    Ok(m.experts.bytes() / (h.n_layer as u64 * h.n_expert as u64))
}

/// Keeps the first of equal values, in order.
fn first_of_each<T: PartialEq + Copy>(v: &mut Vec<T>) {
    let mut seen = Vec::with_capacity(v.len());
    v.retain(|x| {
        !seen.contains(x) && {
            seen.push(*x);
            true
        }
    });
}

fn simulate_cmd(mut a: SimulateArgs) -> Result<()> {
    // A policy or size named twice is simulated once (its row would repeat).
    first_of_each(&mut a.policy);
    first_of_each(&mut a.slots);
    let trace = Trace::read(&a.trace)?;
    if trace.records.is_empty() {
        bail!("{}: a header and no records: nothing to simulate", a.trace.display());
    }
    let per_expert = a.model.as_deref().map(|m| expert_bytes(m, &trace)).transpose()?;
    let h = trace.header;
    let lookups = trace.lookups().count() as u64;
    let loc = trace.locality();
    println!(
        "trace {}: {} records, {lookups} lookups; {} layers, top-{} of {} experts",
        a.trace.display(),
        trace.records.len(),
        h.n_layer,
        h.k,
        h.n_expert
    );
    println!(
        "locality: {:.1}% of a token's experts reused at the next token, {:.1}% within 8, median reuse distance {}",
        loc.reused_next * 100.0,
        loc.reused_within_8 * 100.0,
        loc.median_reuse_distance
    );
    let tokens = trace.records.len() as f64 / h.n_layer as f64;
    println!(
        "\n| slots | policy | hit rate | Belady{} | uploads | bypassed | {} |",
        if a.upload_cap.is_some() { " (no cap)" } else { "" },
        if per_expert.is_some() {
            "MB of misses per token"
        } else {
            "misses per token"
        }
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    for &slots in &a.slots {
        let best = belady_hits(&trace, slots) as f64 / lookups.max(1) as f64;
        for &policy in &a.policy {
            let s = simulate(
                &trace,
                &SimConfig {
                    slots,
                    policy,
                    upload_cap: a.upload_cap,
                },
            );
            // Every miss crosses the link (into a slot, or staged for its step) unless the CPU computes it.
            let misses = (s.admitted + s.bypassed) as f64;
            let per_token = match per_expert {
                Some(b) => format!("{:.1}", misses * b as f64 / tokens / 1e6),
                None => format!("{:.1}", misses / tokens),
            };
            println!(
                "| {slots} | {policy} | {:.1}% | {:.1}% | {} | {} | {per_token} |",
                s.hit_rate() * 100.0,
                best * 100.0,
                s.admitted,
                s.bypassed
            );
        }
    }
    if a.policy.contains(&Policy::Profile) {
        println!(
            "\n`profile` is filled before the trace with its most used experts (an oracle profile; those uploads are counted), so its first uses hit: Belady bounds caches filled on demand, not it."
        );
    }
    Ok(())
}

fn synth_cmd(a: SynthTraceArgs) -> Result<()> {
    if let Some(what) = geometry_error(a.layers, a.experts, a.k) {
        bail!("--layers {} --experts {} --k {}: {what}", a.layers, a.experts, a.k);
    }
    if a.tokens.saturating_mul(a.layers as u64 * a.k as u64) > MAX_LOOKUPS {
        bail!(
            "--tokens {} x --layers {} x --k {} lookups: above the {MAX_LOOKUPS} a trace may hold",
            a.tokens,
            a.layers,
            a.k
        );
    }
    let base = if a.random {
        SynthRouting::RANDOM
    } else {
        SynthRouting::QWEN3_30B
    };
    let r = SynthRouting {
        reuse_next: a.reuse_next.unwrap_or(base.reuse_next),
        reuse_2_to_8: a.reuse_2_to_8.unwrap_or(base.reuse_2_to_8),
        zipf: a.zipf,
    };
    if r.reuse_next + r.reuse_2_to_8 > 1.0 {
        bail!(
            "--reuse-next {} and --reuse-2-to-8 {} are probabilities of one pick: their sum must be at most 1",
            r.reuse_next,
            r.reuse_2_to_8
        );
    }
    if std::fs::symlink_metadata(&a.out).is_ok_and(|m| m.len() > 0 || !m.is_file()) && !Trace::is_trace_file(&a.out) {
        bail!(
            "--out {}: the file is there and is not a routing trace; it is left as it is (give a new file, or remove it)",
            a.out.display()
        );
    }
    let trace = synth_trace(a.layers, a.experts, a.k, a.tokens, r, a.seed);
    trace.write(&a.out)?;
    let l = trace.locality();
    eprintln!(
        "strata: wrote {} ({} tokens x {} layers, top-{} of {}): {:.1}% of a token's experts reused at the next token, {:.1}% within 8, median reuse distance {}",
        a.out.display(),
        a.tokens,
        a.layers,
        a.k,
        a.experts,
        l.reused_next * 100.0,
        l.reused_within_8 * 100.0,
        l.median_reuse_distance
    );
    Ok(())
}
