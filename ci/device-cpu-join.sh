# Whether STRATA_CPU_JOIN (declared not exact) changes logits where the CPU computes expert misses: on and off, a
# 16-slot expert cache with --miss-policy cpu and auto, tokens and logits against the default (join on).
# Run on the device machine with the release binaries in carry/: bash ci/device-cpu-join.sh
set -u
mkdir -p $OUT/j
sed -e 's/switches: exact/switches: [CPU_JOIN]/' -e 's/^name: h200-switches/name: h200-cpu-join/' \
    -e 's/"--expert-cache", "64", "--miss-policy", "upload"/"--expert-cache", "16", "--miss-policy", "cpu"/' \
    -e 's/"--expert-cache", "64", "--miss-policy", "auto"/"--expert-cache", "16", "--miss-policy", "auto"/' \
    -e 's/name: upload/name: cpu16/' -e 's/name: auto/name: auto16/' scenarios/h200-switches.yaml > /tmp/cpu-join.yaml
timeout 300 carry/strata-harness run /tmp/cpu-join.yaml --strata carry/strata --out $OUT/j > $OUT/cpu-join.txt 2>&1
echo "== CPU_JOIN rc=$?"; tail -1 $OUT/cpu-join.txt
J=$(ls -d $OUT/j/*/ | head -1); grep -E "^- " $J/report.md | head -12
grep -h "miss policy\|misses" $J/logs/*.log | sort | uniq -c | head -8
grep -A12 "## Side by side" $J/report.md
(cd $OUT && tar czf cpu-join-report.tgz j cpu-join.txt && rm -rf j)
