# Sourced by the device scripts (ci/device-mmq-prefill.sh, ci/device-h200-load.sh), not run: `load ARM` runs
# scenarios/h200-load.yaml's arm ARM (slots=ARM: 5 client counts of 15 s and a server start, about 90 s) while the
# call has 100 s left of BUDGET, with carry/strata-harness and carry/strata (or $STRATA); the report goes to $OUT/load-ARM.md, the
# logs under $OUT/logs, and its single-stream and load rows are printed.
load() {
  [ $SECONDS -lt $((BUDGET - 100)) ] || return
  local arm=$1
  mkdir -p $OUT/load
  timeout $((BUDGET - SECONDS - 10)) carry/strata-harness run scenarios/h200-load.yaml --strata ${STRATA:-carry/strata} --arm slots=$arm --out $OUT/load > $OUT/logs/load-$arm.log 2>&1; echo "== load $arm rc $? at ${SECONDS}s"
  f=$(ls -d $OUT/load/*/ 2>/dev/null | head -1)
  [ -n "$f" ] && [ -f "$f/report.md" ] || { tail -5 $OUT/logs/load-$arm.log; rm -rf $OUT/load; return; }
  cp $f/report.md $OUT/load-$arm.md; cp -r $f/logs $OUT/logs/load-$arm; rm -rf $OUT/load
  grep -E "^\| (single|load)" $OUT/load-$arm.md
}
