# Issue 17 point 5 on a real GPU: every exact speed switch flipped from the sm_90 defaults must give bit-identical
# tokens and logits (scenarios/h200-switches.yaml); ci/device-inexact.sh tries the inexact ones the same way.
# Run on the device machine with the release binaries in carry/: bash ci/device-switches.sh
set -u
mkdir -p $OUT/r
nvidia-smi -L
export RUST_BACKTRACE=0
timeout 300 carry/strata-harness run scenarios/h200-switches.yaml --strata carry/strata --out $OUT/r > $OUT/harness.txt 2>&1
echo "== h200-switches rc=$?"; tail -2 $OUT/harness.txt
R=$(ls -d $OUT/r/*/ | head -1)
grep -h "speed switch" $R/logs/*.log | sort | uniq -c
grep -E "^- " $R/report.md | head -20
ls $R/*.png
cat $R/logs/*upload*defaults*.events.jsonl | grep '"memory"' | head -5 | cut -c1-300
(cd $OUT && tar czf switches-report.tgz r harness.txt && rm -rf r)
