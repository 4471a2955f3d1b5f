import sys, collections, re
inc = collections.Counter(); total = 0; selfc = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    frames = stack.split(";")
    if not any("_loop (rollout/engine.py" in f or "_loop (/work/main/rollout/engine.py" in f for f in frames):
        continue
    total += n
    seen = set()
    for f in frames:
        name = re.sub(r":\d+\)", ")", f)
        if name not in seen:
            seen.add(name); inc[name] += n
    selfc[re.sub(r":\d+\)", ")", frames[-1])] += n
print("samples in _loop", total)
for k, v in inc.most_common(int(sys.argv[2])):
    print(f"{100*v/total:5.1f}% {k}")
print("--- self")
for k, v in selfc.most_common(25):
    print(f"{100*v/total:5.1f}% {k}")
