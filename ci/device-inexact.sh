# The speed switches declared not exact (DEVICE_SLOT_TABLE, CPU_JOIN), each flipped from the sm_90 default, with
# tokens and logits checked against the defaults as the exact ones are: all experts resident, and a 16-slot expert
# cache with --miss-policy auto and cpu. Where the CPU computes misses their logits are expected to differ.
# Run on the device machine with the release binaries in carry/: bash ci/device-inexact.sh
set -u
mkdir -p $OUT/j
sed -e 's/switches: exact/switches: [DEVICE_SLOT_TABLE, CPU_JOIN]/' -e 's/^name: h200-switches/name: h200-inexact/' \
    -e 's/"--expert-cache", "64"/"--expert-cache", "16"/' scenarios/h200-switches.yaml > /tmp/inexact.yaml
timeout 300 carry/strata-harness run /tmp/inexact.yaml --strata carry/strata --out $OUT/j > $OUT/inexact.txt 2>&1
echo "== inexact rc=$?"; tail -1 $OUT/inexact.txt
J=$(ls -d $OUT/j/*/ | head -1); grep -E "^- " $J/report.md | head -16
grep -h "of [0-9]* misses in a decode layer-step" $J/logs/*.log | sed 's/.*: of/of/' | sort | uniq -c
(cd $OUT && tar czf inexact-report.tgz j inexact.txt && rm -rf j)
