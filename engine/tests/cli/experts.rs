//! `strata experts synth-trace` and `strata experts simulate` as a user runs them, and on bad input.

use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A locality trace, then the simulator over it: one table row per size and policy, LRU at or under Belady, and
/// more hits with more slots.
#[test]
fn synth_trace_then_simulate_prints_hit_rates_beside_belady() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    let t = trace.to_str().unwrap();
    let out = strata(&["experts", "synth-trace", "--out", t, "--layers", "8", "--tokens", "200"]);
    let (_, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("reused at the next token"), "{err}");
    let out = strata(&["experts", "simulate", t, "--slots", "128,512"]);
    let (table, err) = text(&out);
    assert!(out.status.success(), "{err}");
    // | slots | policy | hit rate | Belady | ...
    let rows: Vec<Vec<String>> = table
        .lines()
        .filter(|l| l.starts_with("| 128 ") || l.starts_with("| 512 "))
        .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    assert_eq!(rows.len(), 4, "{table}");
    let pct = |s: &str| s.trim_end_matches('%').parse::<f64>().unwrap();
    for r in &rows {
        assert!(pct(&r[3]) <= pct(&r[4]), "a policy beat Belady: {r:?}");
    }
    let lru: Vec<f64> = rows.iter().filter(|r| r[2] == "lru").map(|r| pct(&r[3])).collect();
    assert!(lru[0] < lru[1] && lru[0] > 10.0, "{table}");
    // A size or policy given twice is one row.
    let out = strata(&["experts", "simulate", t, "--slots", "128,128", "--policy", "lru,lru"]);
    let (table, err) = text(&out);
    assert!(out.status.success(), "{err}");
    assert_eq!(table.lines().filter(|l| l.starts_with("| 128 ")).count(), 1, "{table}");
}

#[test]
fn bad_input_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = strata(&["experts", "simulate", "/nonexistent/t.jsonl", "--slots", "8"]);
    let (_, err) = text(&missing);
    assert_eq!(missing.status.code(), Some(1), "{err}");
    assert!(err.contains("/nonexistent/t.jsonl"), "{err}");

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"strata_routing_trace\":1,\"n_layer\":2,\"n_expert\":8,\"k\":2}\n{\"step\":0,\"layer\":5,\"token\":0,\"experts\":[1,2]}\n",
    )
    .unwrap();
    let out = strata(&["experts", "simulate", bad.to_str().unwrap(), "--slots", "8"]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("bad.jsonl:2: layer 5 of a 2-layer trace"), "{err}");

    for args in [
        &["experts", "simulate", "x", "--slots", "many"][..],
        &["experts", "simulate", "x", "--slots", "8", "--policy", "fifo"],
        &["experts", "synth-trace"],
        &["experts", "synth-trace", "--out", "t", "--random", "--zipf", "1"],
    ] {
        let out = strata(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out).1);
    }
    let t = dir.path().join("t.jsonl");
    let out_t = t.to_str().unwrap();
    for (flag, value, code) in [
        ("--k", "0", 2),
        ("--reuse-next", "1.5", 2),
        ("--zipf", "-1", 2),
        ("--zipf", "nan", 2),
        ("--k", "9", 1),
        ("--tokens", "18446744073709551615", 1),
    ] {
        let arg = format!("{flag}={value}");
        let out = strata(&["experts", "synth-trace", "--out", out_t, "--experts", "8", &arg]);
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(code), "{arg}: {err}");
        assert!(err.contains(flag), "{arg}: {err}");
    }
    let out = strata(&[
        "experts",
        "synth-trace",
        "--out",
        out_t,
        "--reuse-next",
        "0.9",
        "--reuse-2-to-8",
        "0.9",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!t.exists(), "a refused trace was written");

    // A model whose experts are not the trace's prices nothing.
    let out = strata(&[
        "experts",
        "synth-trace",
        "--out",
        out_t,
        "--layers",
        "2",
        "--tokens",
        "5",
    ]);
    assert!(out.status.success());
    let out = strata(&[
        "experts",
        "simulate",
        out_t,
        "--slots",
        "8",
        "--model",
        "synth:tiny-qwen3moe",
    ]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("4 layers of 16 experts, top-4, but the trace is of 2 layers of 128 experts, top-8"),
        "{err}"
    );
    // A header and no records.
    std::fs::write(
        &t,
        "{\"strata_routing_trace\":1,\"n_layer\":2,\"n_expert\":8,\"k\":2}\n",
    )
    .unwrap();
    let out = strata(&["experts", "simulate", out_t, "--slots", "8"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).1.contains("no records"));
}

/// The expert cache's flags on bad input: a value that cannot be one is refused at parse (exit 2, naming the
/// flag); `--routing-trace` on the CPU is refused before the model is read, naming the flag and what it needs.
#[test]
fn expert_cache_flags_refuse_bad_values_by_name() {
    for (flag, v) in [
        ("--expert-cache", "lots"),
        ("--expert-cache", "99999999"),
        ("--vram-budget", "0"),
        ("--vram-budget", "12 parsecs"),
        ("--vram-reserve-mib", "-5"),
        ("--expert-policy", "fifo"),
        ("--routing-trace", "synth:zipf"),
        ("--routing-trace", "synth:uniform:seven"),
    ] {
        let arg = format!("{flag}={v}");
        let out = strata(&["generate", "--prompt", "hi", &arg]);
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{arg}: {err}");
        assert!(err.contains(flag), "{arg}: {err}");
    }
    let out = strata(&[
        "generate",
        "--prompt",
        "hi",
        "--model",
        "/nonexistent.gguf",
        "--routing-trace",
        "t.jsonl",
    ]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--routing-trace") && err.contains("cuda:N") && !err.contains("nonexistent"),
        "{err}"
    );
}

/// Runs `strata serve ARGS`, which must exit by itself within a minute: its exit code and stderr.
fn serve_exit(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("serve")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("serve {args:?} did not exit");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

/// `strata serve --routing-trace` that the worker would refuse (on the CPU, or a trace that cannot be read) is one
/// error at start, not a worker restarted for ever behind a 503.
#[test]
fn serve_refuses_a_routing_trace_it_cannot_use_before_starting_a_worker() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("zeros.jsonl");
    std::fs::write(&bad, vec![0u8; 100]).unwrap();
    for (device, trace) in [("cpu", "/nonexistent.jsonl"), ("cuda:0", bad.to_str().unwrap())] {
        let (code, err) = serve_exit(&["--port", "0", "--device", device, "--routing-trace", trace]);
        assert_eq!(code, Some(1), "{device}: {err}");
        assert!(
            err.contains("--routing-trace") || err.contains("--device cuda:0"),
            "{device}: {err}"
        );
    }
}

/// The expert-profile flags on the CPU: a routing trace read as a profile is accepted and changes no token (the
/// CPU has no cache to pre-fill); `--expert-policy profile` without a profile, `--save-expert-profile` (nothing
/// counts lookups on a CPU), a file that is not a profile, a profile of another model and a dense model are each
/// refused by name, by `generate` and by `serve` before it starts a worker, and the file is left as it was.
#[test]
fn expert_profile_flags_are_checked_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let path = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let gen_args = [
        "generate",
        "--model",
        "synth:tiny-qwen3moe",
        "--prompt",
        "hello",
        "--max-tokens",
        "4",
    ];
    let run = |extra: &[&str]| {
        let out = strata(
            &gen_args
                .iter()
                .copied()
                .chain(extra.iter().copied())
                .collect::<Vec<_>>(),
        );
        let (o, e) = text(&out);
        (out.status.code(), o, e)
    };
    let (code, plain, err) = run(&["--dump-routing", &path("r.jsonl")]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = run(&["--expert-profile", &path("r.jsonl")]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, plain, "a profile changed the CPU's tokens");
    std::fs::write(path("notes.txt"), "keep me\n").unwrap();
    let mut other = strata_engine::experts::profile::ExpertProfile::new(2, 3);
    other.add(&[1, 2, 3, 4, 5, 6]);
    other.write(std::path::Path::new(&path("other.json"))).unwrap();
    let refused: [(Vec<String>, &[&str]); 5] = [
        (
            vec!["--expert-policy".into(), "profile".into()],
            &["--expert-policy profile", "--expert-profile FILE"],
        ),
        (
            vec!["--save-expert-profile".into(), path("notes.txt")],
            &["--save-expert-profile", "--dump-routing"],
        ),
        (
            vec!["--expert-profile".into(), path("notes.txt")],
            &["notes.txt", "not an expert profile"],
        ),
        (
            vec!["--expert-profile".into(), path("other.json")],
            &["other.json", "2 layers x 3 experts", "4 x 16"],
        ),
        (
            vec!["--expert-profile".into(), path("missing.json")],
            &["missing.json", "cannot read it"],
        ),
    ];
    for (flags, want) in &refused {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let (code, _, err) = run(&flags);
        assert_eq!(code, Some(1), "{flags:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)), "{flags:?}: {err}");
        let mut serve = vec!["--port", "0", "--model", "synth:tiny-qwen3moe"];
        serve.extend(&flags);
        let (code, err) = serve_exit(&serve);
        assert_eq!(code, Some(1), "serve {flags:?}: {err}");
        assert!(want.iter().all(|w| err.contains(w)), "serve {flags:?}: {err}");
    }
    let dense = strata(&[
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--expert-profile",
        &path("r.jsonl"),
    ]);
    let (_, err) = text(&dense);
    assert_eq!(dense.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--expert-profile") && err.contains("no routed experts"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(path("notes.txt")).unwrap(), "keep me\n");
}

/// `--dump-routing` on the CPU: the trace has a record per (step, MoE layer, token) of every forward step, reads
/// back and simulates; dumping changes no token; two runs route alike; a second run appends after the first's
/// last step; a dense model and a file that is not this model's trace are refused by name.
#[test]
fn dump_routing_records_every_step_and_appends() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("routing.jsonl");
    let d = dump.to_str().unwrap();
    let gen_args = [
        "generate",
        "--model",
        "synth:tiny-qwen3moe",
        "--prompt",
        "hello world",
        "--max-tokens",
        "4",
    ];
    let plain = strata(&gen_args);
    assert!(plain.status.success(), "{}", text(&plain).1);
    let with: Vec<&str> = gen_args.iter().copied().chain(["--dump-routing", d]).collect();
    let dumped = strata(&with);
    let (out, err) = text(&dumped);
    assert!(dumped.status.success(), "{err}");
    assert_eq!(out, text(&plain).0, "dumping the routing changed the tokens");
    let t = strata_engine::experts::trace::Trace::read(&dump).unwrap();
    let h = t.header;
    assert_eq!((h.n_layer, h.n_expert, h.k), (4, 16, 4));
    // The prompt's tokens in one step, then one step per fed-back token (the last generated one is not fed).
    let prompt: usize = err
        .split("prompt ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no prompt count in {err}"));
    assert_eq!(t.records.len(), 4 * (prompt + 3), "{err}");
    let steps: Vec<u64> = t.records.iter().map(|r| r.0).collect();
    assert_eq!((steps[0], *steps.last().unwrap()), (0, 3));
    assert_eq!(t.records.iter().filter(|r| r.0 == 0 && r.1 == 0).count(), prompt);
    // The same run again routes the same, and its steps follow the first run's.
    assert!(strata(&with).status.success());
    let twice = strata_engine::experts::trace::Trace::read(&dump).unwrap();
    let n = t.records.len();
    assert_eq!(twice.records.len(), 2 * n);
    assert_eq!(twice.records[n].0, 4);
    assert_eq!(&twice.experts[n * 4..], &t.experts[..]);
    let sim = strata(&[
        "experts",
        "simulate",
        d,
        "--slots",
        "8",
        "--model",
        "synth:tiny-qwen3moe",
    ]);
    assert!(sim.status.success(), "{}", text(&sim).1);
    assert!(text(&sim).0.contains("| 8 | lru |"), "{}", text(&sim).0);
    // Refused by name: a dense model; a file holding something else, left as it was.
    let dense = strata(&["generate", "--prompt", "hi", "--max-tokens", "1", "--dump-routing", d]);
    let (_, err) = text(&dense);
    assert_eq!(dense.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--dump-routing") && err.contains("no routed experts"),
        "{err}"
    );
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "keep me\n").unwrap();
    let mut other = gen_args.to_vec();
    other.extend(["--dump-routing", notes.to_str().unwrap()]);
    let out = strata(&other);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("notes.txt") && err.contains("not a routing trace"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "keep me\n");
    // `serve` refuses it before starting a worker, instead of restarting one for ever.
    let (code, err) = serve_exit(&[
        "--port",
        "0",
        "--model",
        "synth:tiny-qwen3moe",
        "--dump-routing",
        notes.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--dump-routing") && err.contains("not a routing trace"),
        "{err}"
    );
    // `synth-trace --out` does not replace it either.
    let out = strata(&[
        "experts",
        "synth-trace",
        "--out",
        notes.to_str().unwrap(),
        "--layers",
        "2",
        "--tokens",
        "2",
    ]);
    let (_, err) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not a routing trace") && err.contains("left as it is"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "keep me\n");
    // A write that fails ends the dump with one line, and the command's exit status says so.
    if std::path::Path::new("/dev/full").exists() {
        let mut full = gen_args.to_vec();
        full.extend(["--dump-routing", "/dev/full"]);
        let out = strata(&full);
        let (_, err) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.matches("no more routing is written").count(), 1, "{err}");
        assert!(err.contains("the routing was not all written"), "{err}");
    }
}
