# CPU model of the barrier protocol (python3 protocol_sim.py: "runs 7680 bad 0"); mutations
# (one shared full barrier per stage, unconditional order arrive) make it fail.
# Randomised interleaving model of wstile_lse.cu's protocol: mbarrier parity waits, TMA fills
# landing later, per-consumer full barriers, empty barriers, named order barriers 3/4.
import random, itertools

class MBar:
    def __init__(self, count): self.count, self.pending, self.tx, self.phase = count, count, 0, 0
    def arrive(self, tx=0):
        self.pending -= 1; self.tx += tx; self._chk()
    def complete_tx(self, b): self.tx -= b; self._chk()
    def _chk(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1; self.pending = self.count
    def try_wait(self, parity): return (self.phase & 1) != parity

class NBar:  # named barrier, 2 warpgroups of 128 (count 256)
    def __init__(self): self.arrived, self.gen = 0, 0
    def arrive(self):
        self.arrived += 1
        if self.arrived == 2: self.arrived = 0; self.gen += 1

def run(my_tiles, KT, ST, PP, AR, seed):
    rng = random.Random(seed)
    full = [[MBar(1) for _ in range(ST)] for _ in range(2)]
    empty = [MBar(1) for _ in range(ST)]
    abar = MBar(1)
    stage = [None] * ST          # iteration id whose data is in the stage (None: in flight/garbage)
    areg = [None]
    inflight = []                # (bar, stage or None, it)
    nb = {3: NBar(), 4: NBar()}
    reads = {}                   # stage -> set of readers in flight
    errors = []
    def producer():
        if AR and my_tiles > 0:
            abar.arrive(tx=KT); 
            for kt in range(KT): inflight.append((abar, 'A', kt))
            yield
        s, ph = 0, 0
        for t in range(my_tiles):
            for kt in range(KT):
                it = t * KT + kt
                while not empty[s].try_wait(ph ^ 1): yield
                if reads.get(s): errors.append(f"producer overwrites stage {s} while read by {reads[s]}")
                stage[s] = None
                full[t & 1][s].arrive(tx=1)
                inflight.append((full[t & 1][s], s, it)); yield
                s += 1
                if s == ST: s, ph = 0, ph ^ 1
    def consumer(c):
        fph = 0
        if AR and c < my_tiles:
            while not abar.try_wait(0): yield
        if PP and c == 1 and my_tiles > 0: nb[3].arrive(); yield
        for t in range(c, my_tiles, 2):
            s = (t * KT) % ST
            if PP:
                g = nb[3 + c].gen; nb[3 + c].arrive()
                while nb[3 + c].gen == g: yield
            pend = []
            for kt in range(KT):
                it = t * KT + kt
                while not full[c][s].try_wait((fph >> s) & 1): yield
                fph ^= 1 << s
                if stage[s] != it: errors.append(f"c{c} t{t} kt{kt}: stage {s} holds {stage[s]} not {it}")
                if AR and areg[0] != KT: errors.append("A not resident")
                reads.setdefault(s, set()).add((c, it)); pend.append((s, it)); yield
                if len(pend) == 2:  # wait_group 1, release previous
                    ps, pit = pend.pop(0)
                    if stage[ps] != pit: errors.append(f"stage {ps} changed under MMA {pit}")
                    reads[ps].discard((c, pit)); empty[ps].arrive(); yield
                s = (s + 1) % ST
            if PP and t + 1 < my_tiles: nb[3 + (c ^ 1)].arrive(); yield
            ps, pit = pend.pop(0)
            if stage[ps] != pit: errors.append(f"stage {ps} changed under MMA {pit}")
            reads[ps].discard((c, pit)); empty[ps].arrive(); yield
            for _ in range(rng.randint(0, 5)): yield   # epilogue
        yield 'done'
    agents = {'p': producer(), 'c0': consumer(0), 'c1': consumer(1)}
    done = set(); steps = 0; idle = 0
    while len(done) < 3 or inflight:
        steps += 1
        if steps > 200000: return f"DEADLOCK/limit tiles={my_tiles} KT={KT} ST={ST} PP={PP}"
        choices = [k for k in agents if k not in done] + (['tma'] if inflight else [])
        if not choices: break
        k = rng.choice(choices)
        if k == 'tma':
            i = rng.randrange(len(inflight)); bar, s, it = inflight.pop(i)
            if s == 'A': areg[0] = (areg[0] or 0) + 1
            else: stage[s] = it
            bar.complete_tx(1)
            continue
        try:
            r = next(agents[k])
            if r == 'done': done.add(k)
        except StopIteration:
            done.add(k)
    if any(nb[i].arrived for i in nb): errors.append(f"named barrier left with arrivals {[nb[i].arrived for i in nb]}")
    return errors[:3] if errors else None

bad = 0; n = 0
for PP, AR in itertools.product((True, False), (False, True)):
    for my_tiles in (0, 1, 2, 3, 4, 5, 9, 10):
        for KT in (1, 2, 3, 4, 8):
            for ST in (2, 4, 6, 7):
                for seed in range(12):
                    n += 1
                    r = run(my_tiles, KT, ST, PP, AR, seed)
                    if r: bad += 1; print(PP, AR, my_tiles, KT, ST, seed, r) if bad < 10 else None
print("runs", n, "bad", bad)
