# Sixteenth session: where torch.profiler's first prepare_trace spends its seconds (py-spy --native; carry its
# wheel in .devcarry/whl). Found: importing torch._inductor/_dynamo, not CUPTI.
source .devcarry/setup.sh
cd /tmp && python3 -m zipfile -e $OLDPWD/.devcarry/whl/py_spy*.whl pyspy >/dev/null && chmod +x pyspy/py_spy-*.data/scripts/py-spy; cd - >/dev/null
PYSPY=$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy)
for a in cuda cpu both; do python3 .devcarry/profiler_prepare.py $a; done
$PYSPY record --native -r 100 -f raw -o $OUT/prep_native.txt -- python3 .devcarry/profiler_prepare.py both 2>&1 | tail -3
python3 - <<'PY'
import collections, os
c = collections.Counter(); tot = 0
for line in open(os.environ["OUT"] + "/prep_native.txt"):
    stack, n = line.rsplit(" ", 1); n = int(n); tot += n
    for f in set(stack.split(";")): c[f] += n
for f, n in c.most_common(60): print(f"{n/tot:6.1%} {f[:150]}")
PY
