# Issue 17 on a real GPU: seed 003's sticky fault (injected and a real trap) and seed 000's probe check.
# Run on the device machine with the release binaries in carry/: bash ci/device-faults.sh
set -u
mkdir -p $OUT/r
nvidia-smi -L
export RUST_BACKTRACE=0
for id in $(ls /sys/bus/pci/devices/); do c=$(cat /sys/bus/pci/devices/$id/class 2>/dev/null); case $c in 0x030*) echo "$id $(cat /sys/bus/pci/devices/$id/current_link_speed) x$(cat /sys/bus/pci/devices/$id/current_link_width)";; esac; done
for f in sticky:rms_norm@3 trap:rms_norm@3; do for s in 0 1; do
  n=$(echo $f | tr ':@' '__')-sync$s
  STRATA_FAULT=$f STRATA_SYNC_LAUNCHES=$s timeout 120 carry/strata generate --device cuda:0 --model synth:small-qwen3moe --max-context 512 --prompt "the arena and the cache" --max-tokens 4 > $OUT/gen-$n.txt 2>&1
  echo "== generate $f sync=$s rc=$?"; grep -E "fault|panicked|STRATA_FAULT|failed" $OUT/gen-$n.txt | head -5
done; done
for f in "" probe:unsynced; do
  STRATA_FAULT=$f timeout 120 carry/strata generate --device cuda:0 --model synth:small-qwen3moe --max-context 512 --expert-cache 64 --prompt "the arena and the cache" --max-tokens 4 > "$OUT/gen-probe-${f/:/_}.txt" 2>&1
  echo "== probe '$f' rc=$?"; grep -E "probe|expert cache" "$OUT/gen-probe-${f/:/_}.txt" | head -5
done
timeout 400 carry/strata-harness run scenarios/h200-faults.yaml --strata carry/strata --out $OUT/r > $OUT/harness.txt 2>&1
echo "== harness rc=$?"; tail -3 $OUT/harness.txt
R=$(ls -d $OUT/r/*/ | head -1); sed -n '/## Side by side/,/## Environment/p' $R/report.md
grep -E "^- " $R/report.md | head -20
(cd $OUT && tar czf faults-report.tgz r gen-*.txt harness.txt && rm -rf r gen-*.txt)
