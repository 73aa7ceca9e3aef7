//! `--device sim:PROFILE` as a user runs it: seed 001 replayed on the simulated Strix Halo (a UMA APU whose free
//! memory collapses when the expert arena is registered), both sizings and both stores, against the CPU's tokens.

use std::process::{Command, Output};

fn generate(extra: &[&str]) -> Output {
    let mut args = vec![
        "generate",
        "--model",
        "synth:small-qwen3moe",
        "--max-context",
        "512",
        "--prefill",
        "64",
        "--max-tokens",
        "6",
        "--temp",
        "0",
        "--prompt",
        "the arena and the cache",
    ];
    args.extend_from_slice(extra);
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(&args)
        .output()
        .expect("run strata")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const HALO: &str = "sim:gfx1151-strix-halo";

/// Seed 001: the original's sizing with the arena reproduces the collapse and a failed allocation after the cache,
/// named with the driver's error and what was allocated; every other arm writes the CPU's tokens.
#[test]
fn seed_001_fails_only_with_the_original_sizing_and_the_arena() {
    // The routing of every step, beside the text: equal routing means the same experts computed the same inputs.
    let dir = tempfile::tempdir().unwrap();
    let dump = |name: &str| dir.path().join(name).display().to_string();
    let routing = |name: &str| {
        let t = std::fs::read_to_string(dump(name)).unwrap();
        t.lines().skip(1).map(str::to_string).collect::<Vec<_>>()
    };
    let (cpu, err) = text(&generate(&["--device", "cpu", "--dump-routing", &dump("cpu")]));
    assert!(routing("cpu").len() > 6, "{err}");

    let out = generate(&["--device", HALO, "--cache-sizing", "original"]);
    let (_, err) = text(&out);
    assert!(!out.status.success(), "{err}");
    // The arena registered, the reading collapsed, the cache sized from it, then an allocation after it failed.
    assert!(
        err.contains("hipHostRegister ok") && err.contains("the device now reads"),
        "{err}"
    );
    let sizing = err
        .lines()
        .find(|l| l.contains("expert cache auto:"))
        .expect("a sizing line");
    assert!(sizing.contains("slots") && !sizing.contains("resident"), "{sizing}");
    assert!(err.contains("session is up"), "{err}");
    assert!(
        err.contains("hipErrorOutOfMemory")
            && err.contains("allocated on the device so far")
            && err.contains("memory plan"),
        "{err}"
    );
    assert!(err.contains("registered host memory are charged"), "{err}");

    for (i, arm) in [
        vec!["--device", HALO, "--cache-sizing", "original", "--mmap-experts"],
        vec!["--device", HALO],
        vec!["--device", HALO, "--mmap-experts"],
    ]
    .into_iter()
    .enumerate()
    {
        let file = dump(&i.to_string());
        let out = generate(&[arm.as_slice(), &["--dump-routing", &file]].concat());
        let (tokens, err) = text(&out);
        assert!(out.status.success(), "{arm:?}: {err}");
        assert_eq!(tokens, cpu, "{arm:?}: {err}");
        assert_eq!(routing(&i.to_string()), routing("cpu"), "{arm:?}");
        assert!(err.contains("free with everything loaded"), "{arm:?}: {err}");
    }
}

/// Our sizing on the UMA device when the experts do not all fit: the arena, charged against the device's memory,
/// would leave no room for the plan, so the experts are read in place (one line) and the cache takes the room.
#[test]
fn on_uma_an_arena_that_does_not_fit_the_plan_falls_back_to_mmap() {
    // 30 GiB of the card: the experts (46.84 GiB at this scale) cannot all be resident.
    let out = generate(&["--device", HALO, "--vram-budget", "30GiB"]);
    let (_, err) = text(&out);
    assert!(out.status.success(), "{err}");
    let line: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("reading the experts in place"))
        .collect();
    assert_eq!(line.len(), 1, "{err}");
    assert!(
        line[0].contains("UMA device") && line[0].contains("charges it"),
        "{err}"
    );
    assert!(err.contains("slots on sim:gfx1151-strix-halo"), "{err}");
    assert!(!err.contains("hipHostRegister"), "{err}");
}

/// A profile file the user wrote, found through `STRATA_DEVICE_PROFILES`, and one with a mistake: named with its
/// line.
#[test]
fn a_users_profile_is_found_and_its_mistakes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let good = "name: Test Card\napi: cuda\narch: sm_89\nwave: 32\nmultiprocessors: 8\ncompiled_for: [sm_89]\n\
        memory: {total: 1 GiB, free: 1 GiB}\nhost: {total: 8 GiB, available: 4 GiB}\nlink: {pcie_gen: 4, pcie_width: 8}\n";
    std::fs::write(dir.path().join("mine.yaml"), good).unwrap();
    std::fs::write(dir.path().join("bad.yaml"), good.replace("wave: 32", "wave: 33")).unwrap();
    let run = |device: &str| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .env("STRATA_DEVICE_PROFILES", dir.path())
            .args([
                "generate",
                "--model",
                "synth:tiny-qwen3moe",
                "--device",
                device,
                "--max-tokens",
                "2",
                "--prompt",
                "hi",
            ])
            .output()
            .unwrap()
    };
    let out = run("sim:mine");
    let (_, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("Test Card (sm_89"), "{err}");
    let out = run("sim:bad");
    let (_, err) = text(&out);
    assert!(
        !out.status.success() && err.contains("bad.yaml") && err.contains("wave: 33"),
        "{err}"
    );
}

/// `generate` on the simulated Strix Halo with `STRATA_FAULT` set (and `STRATA_SYNC_LAUNCHES` when `synced`).
fn generate_with_fault(fault: &str, synced: bool) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "generate",
            "--model",
            "synth:small-qwen3moe",
            "--device",
            HALO,
            "--max-context",
            "512",
            "--max-tokens",
            "4",
            "--prompt",
            "the arena and the cache",
        ])
        .env("STRATA_FAULT", fault)
        .env("STRATA_SYNC_LAUNCHES", if synced { "1" } else { "0" })
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run strata");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

/// Seed 003: the second MoE launch poisons the device. Without synchronised launches the `fault` names the next
/// call, an innocent one, as the original's log did; with them, the MoE launch itself. Either way the process
/// stops with the driver's error.
#[test]
fn seed_003_sticky_fault_names_its_kernel_only_when_launches_are_synchronised() {
    let (out, err) = generate_with_fault("sticky:moe_add_rms_norm@2", false);
    assert!(!out.status.success(), "{err}");
    let fault = err
        .lines()
        .find(|l| l.contains("fault: "))
        .unwrap_or_else(|| panic!("no fault line: {err}"));
    assert!(fault.contains("(not synchronised"), "{fault}");
    assert!(
        !fault.contains("fault: moe_add_rms_norm"),
        "the asynchronous fault names its own kernel: {fault}"
    );
    assert!(fault.contains("hipErrorLaunchFailure"), "{fault}");

    let (out, err) = generate_with_fault("sticky:moe_add_rms_norm@2", true);
    assert!(!out.status.success(), "{err}");
    let fault = err
        .lines()
        .find(|l| l.contains("fault: "))
        .unwrap_or_else(|| panic!("no fault line: {err}"));
    assert!(
        fault.contains("fault: moe_add_rms_norm launch #") && fault.contains("(synchronised)"),
        "{fault}"
    );

    // A rule past what the request launches changes nothing, and says that it never fired.
    let (out, err) = generate_with_fault("sticky:moe_add_rms_norm@100000", false);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("fewer than 100000: the fault never fired"), "{err}");
}

/// A sticky rule the device cannot carry out is an error before the model is used, naming the rule.
#[test]
fn sticky_rules_the_device_cannot_run_are_errors() {
    for (rule, says) in [
        ("sticky:no_such_op@1", "has no kernel `no_such_op`"),
        ("trap:moe@1", "a trap needs a real GPU"),
        ("sticky:moe@0", "a launch number N ≥ 1"),
        ("probe:unsynced", "has none (a sim: profile's link.probe_gb_s"),
    ] {
        let (out, err) = generate_with_fault(rule, false);
        assert_eq!(out.status.code(), Some(1), "{rule}: {err}");
        assert!(err.contains(says) && err.contains("STRATA_FAULT"), "{rule}: {err}");
    }
}

/// `strata device` on a simulated card prints what the reported machine's driver listed (seed 000: an iGPU the
/// build was not compiled for as device 0, the RX 7900 XTX as device 1), and its self-test refuses an
/// over-allocation with the driver's error.
#[test]
fn device_lists_and_selftests_a_simulated_card() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("device")
            .args(args)
            .output()
            .expect("run strata");
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let list = run(&["--list-devices", "--device", "sim:gfx1100-rx7900xtx"]);
    let igpu = list.find("device 0: AMD Radeon(TM) Graphics").expect(&list);
    let card = list.find("device 1: AMD Radeon RX 7900 XTX").expect(&list);
    assert!(
        igpu < card && list.contains("cannot run: gfx1036 is not an architecture"),
        "{list}"
    );
    assert!(!list[card..].contains("cannot run"), "{list}");
    let test = run(&[
        "--selftest",
        "--device",
        HALO,
        "--model",
        "synth:small-qwen3moe",
        "--max-context",
        "512",
    ]);
    assert!(
        test.contains("refused as required (hipErrorOutOfMemory)") && test.contains("selftest OK"),
        "{test}"
    );
    assert!(test.contains("plan vs free") && test.contains("FITS"), "{test}");
}
