//! Build script: the commit the binary is built from, for `strata --version` (`STRATA_BUILD_REV`): `git rev-parse
//! --short=12 HEAD` of the source tree, "-dirty" when tracked files differed from it when the script last ran (at a
//! commit, checkout or staged edit, and at any change to the engine's sources or the kernels), or "unknown" outside a
//! git checkout (a source archive). Device reports name the binary's commit from it, not the commit of whatever tree
//! runs the binary.
use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    // `--no-optional-locks`: status must not rewrite .git/index, which would rerun this script (and rebuild the
    // engine) on the next cargo call.
    let rev = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(rev) => {
            let dirty = git(&["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            format!("{rev}{}", if dirty { "-dirty" } else { "" })
        }
        None => "unknown".into(),
    };
    println!("cargo:rustc-env=STRATA_BUILD_REV={rev}");
    // Run again when HEAD moves or the index changes (a commit, a checkout, a staged edit); only paths that exist,
    // since a missing one would make cargo run the script on every build.
    let git_dir = git(&["rev-parse", "--git-dir"]).unwrap_or_default();
    for f in ["HEAD", "index", "refs", "packed-refs"] {
        let p = Path::new(&git_dir).join(f);
        if !git_dir.is_empty() && p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
    // And when the binary's own sources change (they rebuild it anyway), so "-dirty" is right for them.
    for p in ["build.rs", "Cargo.toml", "src", "../kernels"] {
        println!("cargo:rerun-if-changed={p}");
    }
}
