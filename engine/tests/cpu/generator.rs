//! The model generator: synthetic models are deterministic, readable and skewed as asked; upcycled models stack
//! the source's raw FFN blocks.

use std::path::Path;

use strata_engine::fixtures::synth::{SynthArch, SynthSpec, TensorTypes};
use strata_engine::fixtures::upcycle::{UpcycleMode, UpcycleSpec, upcycle};
use strata_engine::gguf::GgufModel;
use strata_engine::model::HParams;
use strata_engine::models;
use strata_engine::quant::{self, GgmlType};

fn small(arch: SynthArch) -> SynthSpec {
    SynthSpec {
        arch,
        n_layer: 2,
        n_embd: 256,
        n_ff: 512,
        vocab_size: 512,
        ..SynthSpec::tiny_qwen3moe()
    }
}

fn sha(path: &Path) -> Vec<u8> {
    // FNV-1a over the whole file is enough to tell two files apart in a test.
    let bytes = std::fs::read(path).unwrap();
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        })
        .to_le_bytes()
        .to_vec()
}

#[test]
fn same_spec_gives_a_byte_identical_file_and_another_seed_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let spec = small(SynthArch::Qwen3moe);
    let (a, b, c) = (
        dir.path().join("a.gguf"),
        dir.path().join("b.gguf"),
        dir.path().join("c.gguf"),
    );
    spec.write(&a).unwrap();
    spec.write(&b).unwrap();
    SynthSpec {
        seed: spec.seed + 1,
        ..spec.clone()
    }
    .write(&c)
    .unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_ne!(sha(&a), sha(&c));
}

#[test]
fn every_architecture_reads_back_with_its_hyper_parameters() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [
        SynthArch::Llama,
        SynthArch::Mixtral,
        SynthArch::Qwen3,
        SynthArch::Qwen3moe,
    ] {
        let spec = SynthSpec {
            types: TensorTypes::uniform(GgmlType::Q4_0),
            ..small(arch)
        };
        let path = dir.path().join(format!("{arch:?}.gguf"));
        spec.write(&path).unwrap();
        let model = GgufModel::open(&path).unwrap();
        let hp = HParams::from_metadata(model.metadata()).unwrap();
        assert_eq!(hp.arch.name(), arch.gguf_arch());
        assert_eq!((hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv), (2, 256, 4, 2));
        assert_eq!(hp.is_moe(), arch.is_moe(), "{arch:?}");
        assert_eq!(model.tensors().len(), spec.tensors().unwrap().len());
        let qk_norm = model.tensor("blk.0.attn_q_norm.weight").is_some();
        assert_eq!(
            qk_norm,
            matches!(arch, SynthArch::Qwen3 | SynthArch::Qwen3moe),
            "{arch:?}"
        );
        // The hyper-parameters a loader reads agree with the tensors' shapes.
        if arch.is_moe() {
            let t = model.tensor("blk.1.ffn_down_exps.weight").unwrap();
            assert_eq!(t.dims, vec![256, 256, 16]);
            assert_eq!(t.ty, GgmlType::Q4_0);
            let gate = model.tensor("blk.0.ffn_gate_exps.weight").unwrap();
            assert_eq!(
                (gate.dims[1], gate.dims[2]),
                (hp.n_ff_exp as u64, hp.n_expert as u64),
                "{arch:?}"
            );
        } else {
            assert_eq!(
                model.tensor("blk.0.ffn_gate.weight").unwrap().dims[1],
                hp.n_ff as u64,
                "{arch:?}"
            );
        }
        let q = model.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(q.dims, vec![hp.n_embd as u64, (hp.n_head * hp.head_dim) as u64]);
        // Weights dequantize to the requested RMS (1/√n_in), within quantization error.
        let q = model.tensor("blk.0.attn_q.weight").unwrap();
        let mut w = vec![0f32; q.n_elements() as usize];
        quant::dequantize(q.ty, model.tensor_data(q), &mut w).unwrap();
        let rms = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
        assert!((rms * 16.0 - 1.0).abs() < 0.05, "{arch:?}: rms {rms}");
    }
}

/// Fraction of top-k selections that go to each expert, for the router of `layer`, over every token embedding.
fn routing_histogram(model: &GgufModel, layer: u32) -> Vec<f64> {
    let hp = HParams::from_metadata(model.metadata()).unwrap();
    let (n_embd, n_expert, k) = (hp.n_embd as usize, hp.n_expert as usize, hp.n_expert_used as usize);
    let emb = model.tensor("token_embd.weight").unwrap();
    let mut x = vec![0f32; emb.n_elements() as usize];
    quant::dequantize(emb.ty, model.tensor_data(emb), &mut x).unwrap();
    let router = model.tensor(&format!("blk.{layer}.ffn_gate_inp.weight")).unwrap();
    let mut w = vec![0f32; router.n_elements() as usize];
    quant::dequantize(router.ty, model.tensor_data(router), &mut w).unwrap();
    let mut counts = vec![0usize; n_expert];
    for tok in x.chunks(n_embd) {
        let rms = (tok.iter().map(|v| v * v).sum::<f32>() / n_embd as f32).sqrt();
        let mut logits: Vec<(f32, usize)> = w
            .chunks(n_embd)
            .enumerate()
            .map(|(e, row)| (row.iter().zip(tok).map(|(a, b)| a * b / rms).sum::<f32>(), e))
            .collect();
        logits.sort_by(|a, b| b.0.total_cmp(&a.0));
        for &(_, e) in &logits[..k] {
            counts[e] += 1;
        }
    }
    let total = counts.iter().sum::<usize>() as f64;
    let mut freq: Vec<f64> = counts.iter().map(|&c| c as f64 / total).collect();
    freq.sort_by(|a, b| b.total_cmp(a));
    freq
}

#[test]
fn zipf_exponent_controls_router_skew() {
    let dir = tempfile::tempdir().unwrap();
    let spec = |zipf| SynthSpec {
        zipf,
        vocab_size: 2048,
        ..small(SynthArch::Qwen3moe)
    };
    let (flat, skewed) = (dir.path().join("flat.gguf"), dir.path().join("skewed.gguf"));
    spec(0.0).write(&flat).unwrap();
    spec(1.5).write(&skewed).unwrap();
    let flat = routing_histogram(&GgufModel::open(&flat).unwrap(), 1);
    let skewed = routing_histogram(&GgufModel::open(&skewed).unwrap(), 1);
    // 16 experts, top-4: uniform routing gives each 1/16 of the selections.
    let top4 = |f: &[f64]| f[..4].iter().sum::<f64>();
    eprintln!("routing shares, most popular first:\n  zipf 0   {flat:.3?}\n  zipf 1.5 {skewed:.3?}");
    assert!(top4(&flat) < 0.4, "uniform router too skewed: {flat:?}");
    assert!(top4(&skewed) > 0.6, "zipf 1.5 router not skewed enough: {skewed:?}");
    assert!(
        skewed[15] < flat[15],
        "least popular expert should lose share: {skewed:?} vs {flat:?}"
    );
}

#[test]
fn invalid_specs_are_errors_not_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    let spec = SynthSpec {
        n_embd: 100,
        types: TensorTypes::uniform(GgmlType::Q4_K),
        ..small(SynthArch::Llama)
    };
    let err = spec.write(&path).unwrap_err().to_string();
    assert!(err.contains("token_embd.weight") && err.contains("Q4_K"), "{err}");
    assert!(!path.exists());
    // Absurd sizes fail at once, before anything is allocated or written.
    for (spec, says) in [
        (
            SynthSpec {
                n_layer: u32::MAX,
                ..small(SynthArch::Llama)
            },
            "n_layer",
        ),
        (
            SynthSpec {
                n_embd: u32::MAX - 31,
                vocab_size: u32::MAX,
                ..small(SynthArch::Llama)
            },
            "n_embd",
        ),
        (
            SynthSpec {
                n_embd: 65536,
                vocab_size: 1 << 22,
                types: TensorTypes::uniform(GgmlType::F32),
                ..small(SynthArch::Llama)
            },
            "16 GiB",
        ),
        (
            SynthSpec {
                zipf: 1e308,
                ..small(SynthArch::Qwen3moe)
            },
            "zipf",
        ),
        (
            SynthSpec {
                zipf: f64::NAN,
                ..small(SynthArch::Qwen3moe)
            },
            "zipf",
        ),
    ] {
        let err = spec.write(&path).unwrap_err().to_string();
        assert!(err.contains(says), "{says}: {err}");
        assert!(!path.exists());
    }
}

fn default_model() -> GgufModel {
    GgufModel::open(models::require(models::DEFAULT_MODEL_FILE).unwrap_or_else(|e| panic!("{e}"))).unwrap()
}

#[test]
fn upcycle_stacks_the_source_blocks_in_both_modes() {
    let src = default_model();
    let dir = tempfile::tempdir().unwrap();
    for mode in [UpcycleMode::Identical, UpcycleMode::Shifted] {
        let out = dir.path().join("moe.gguf");
        let spec = UpcycleSpec {
            mode,
            n_expert: 4,
            n_expert_used: 2,
            seed: 3,
        };
        upcycle(&src, &spec, &out).unwrap();
        let moe = GgufModel::open(&out).unwrap();
        let hp = HParams::from_metadata(moe.metadata()).unwrap();
        assert_eq!((hp.n_expert, hp.n_expert_used, hp.n_layer), (4, 2, 30));
        assert!(moe.tensor("blk.0.ffn_gate.weight").is_none());
        for layer in [0u32, 29] {
            for part in ["ffn_gate", "ffn_up", "ffn_down"] {
                let stacked = moe.tensor(&format!("blk.{layer}.{part}_exps.weight")).unwrap();
                let data = moe.tensor_data(stacked);
                let one = data.len() / 4;
                for e in 0..4u32 {
                    let from = match mode {
                        UpcycleMode::Identical => layer,
                        UpcycleMode::Shifted => (layer + e) % 30,
                    };
                    let source = src.tensor(&format!("blk.{from}.{part}.weight")).unwrap();
                    assert_eq!(stacked.ty, source.ty);
                    assert_eq!(&stacked.dims[..2], &source.dims[..]);
                    let chunk = &data[e as usize * one..(e as usize + 1) * one];
                    assert!(
                        chunk == src.tensor_data(source),
                        "{mode:?} layer {layer} {part} expert {e}"
                    );
                }
            }
            let router = moe.tensor(&format!("blk.{layer}.ffn_gate_inp.weight")).unwrap();
            assert_eq!((router.ty, router.dims.clone()), (GgmlType::F32, vec![576, 4]));
        }
        // Everything else is copied byte for byte.
        for name in ["token_embd.weight", "blk.7.attn_q.weight", "output_norm.weight"] {
            assert!(moe.tensor_data(moe.tensor(name).unwrap()) == src.tensor_data(src.tensor(name).unwrap()));
        }
    }
}

#[test]
fn upcycle_refuses_to_overwrite_its_input_or_to_stack_too_many_experts() {
    let dir = tempfile::tempdir().unwrap();
    let dense = dir.path().join("dense.gguf");
    small(SynthArch::Llama).write(&dense).unwrap();
    let before = std::fs::read(&dense).unwrap();
    let model = GgufModel::open(&dense).unwrap();
    let spec = UpcycleSpec {
        mode: UpcycleMode::Identical,
        n_expert: 2,
        n_expert_used: 1,
        seed: 0,
    };
    let err = upcycle(&model, &spec, &dense).unwrap_err().to_string();
    assert!(err.contains("is the input model"), "{err}");
    assert_eq!(std::fs::read(&dense).unwrap(), before);
    let spec = UpcycleSpec {
        n_expert: 100_000,
        ..spec
    };
    let err = upcycle(&model, &spec, &dir.path().join("big.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("limit") && err.contains("dense.gguf"), "{err}");
    assert!(!dir.path().join("big.gguf").exists());
}

#[test]
fn upcycling_a_moe_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let moe = dir.path().join("moe.gguf");
    small(SynthArch::Mixtral).write(&moe).unwrap();
    let spec = UpcycleSpec {
        mode: UpcycleMode::Identical,
        n_expert: 2,
        n_expert_used: 1,
        seed: 0,
    };
    let err = upcycle(&GgufModel::open(&moe).unwrap(), &spec, &dir.path().join("x.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("expert"), "{err}");
}
