#!/usr/bin/env python3
"""A model, in Python, of the packed candidate buffers of src/cuda/routing/route_warp.cuh
(select_top_k_packed): the lanes' packed buffers, the K packed rounds and the check after them,
in the kSortRepair form (route_warp_wide): two neighbouring picks of one bucket with different
keys send the row to the exact rounds in the last pick's bucket and have the picks sorted above
it (route_warp, without kSortRepair, takes the exact rounds for both: a stricter check). Expert
counts up to 2048 with route_warp_wide's buffer depths. It fuzzes rows (near ties, exact ties,
lane-heavy rows, group-limited rows, bf16 values, non-finite values) and asserts that whenever
the check accepts the fast pass (sorted or not), its picks are the true top-K in (key desc,
expert asc) order. It also reports how often the exact rounds run and how often the sort does.
It also models the packed retry of dry-lane doubts (route_warp, 2-4 stripes) and
asserts that the picks the exact rounds keep are the true first picks, and the bucket
rounds of rows whose only doubt is a collision in the last pick's bucket (route_warp's whole-warp
rows), whose picks it asserts are the true top-K.

This checks the algorithm, not the CUDA code (the GPU tests compare the kernels with the CPU
oracle); run it after changing the check:
  python3 tools/packed_topk_model.py [seed] [rows]
"""
import random
import struct
import sys

stats_detail = False


def fbits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def score_key(q):  # route_warp.cuh canonical_key: NaN -> -inf, -0 -> +0, ordered bits
    if q != q:
        q = float("-inf")
    if q == 0:
        q = 0.0
    u = fbits(q)
    return (u ^ (0xFFFFFFFF if u >> 31 else 0x80000000)) & 0xFFFFFFFF


def bf16(x):
    return struct.unpack("<f", struct.pack("<I", fbits(x) & 0xFFFF0000))[0]


def route(keys, E, K, D=None, bucket_exact=False, retries=None, bucket_rounds=True):
    """Returns 'fast' (check passed; picks verified) or 'exact' (exact rounds would run)."""
    S = (E + 127) // 128
    if retries is None:  # route_warp.cuh's kPackedRetries: one attempt for 3 stripes
        retries = 1 if S == 3 else 2
    kmax = 128 * S
    if D is None:  # route_warp's depth 2 up to E = 512, route_warp_wide's 3 / 4 past it
        D = 2 if S <= 4 else 3 if S <= 8 else 4
    bits = 7 if kmax <= 128 else 8 if kmax <= 256 else 9 if kmax <= 512 else 10 if kmax <= 1024 else 11
    kidx = (1 << bits) - 1
    bp = [[0] * D for _ in range(32)]
    pn = [0] * 32
    for lane in range(32):  # packed_insert, value j of lane l is expert 128 i + 4 l + c
        for j in range(4 * S):
            i, c = divmod(j, 4)
            e = 128 * i + 4 * lane + c
            x = (keys[e] & ~kidx) | (kidx - e)
            b = bp[lane]
            pn[lane] = max(pn[lane], min(x, b[D - 1]))
            for d in range(D - 1, 0, -1):
                b[d] = max(b[d], min(x, b[d - 1]))
            b[0] = max(b[0], x)
    pms = []
    for _ in range(K):  # packed_rounds
        pm = max(b[0] for b in bp)
        pms.append(pm)
        for b in bp:
            if b[0] == pm:
                b[:] = b[1:] + [0]
    # Packed retry (kRetry): while a dry lane hides a bucket at or above the last pick's, keep the
    # picks above every hidden bucket (the first r0: all candidates with packed key >= pick r0 - 1's),
    # rebuild every lane's buffers from its candidates below that pick and redo rounds r0 .. K - 1.
    prev_r0 = 0
    for _ in range(retries):
        last_b = pms[K - 1] & ~kidx
        hb = max((pn[lane] if bp[lane][0] <= kidx else 0) for lane in range(32)) & ~kidx
        if hb < last_b:
            break
        r0 = next(k for k in range(K) if (pms[k] & ~kidx) <= hb)
        if r0 <= prev_r0:
            break
        thr = pms[r0 - 1]
        for lane in range(32):
            b = [0] * D
            n = 0
            for j in range(4 * S):
                i, c = divmod(j, 4)
                e = 128 * i + 4 * lane + c
                x = (keys[e] & ~kidx) | (kidx - e)
                x = x if x < thr else 0
                n = max(n, min(x, b[D - 1]))
                for d in range(D - 1, 0, -1):
                    b[d] = max(b[d], min(x, b[d - 1]))
                b[0] = max(b[0], x)
            bp[lane] = b
            pn[lane] = n
        for k in range(r0, K):
            pm = max(b[0] for b in bp)
            pms[k] = pm
            for b in bp:
                if b[0] == pm:
                    b[:] = b[1:] + [0]
        prev_r0 = r0
    real = [pm > kidx for pm in pms]
    es = [kidx - (pm & kidx) for pm in pms]
    last_bucket = pms[K - 1] & ~kidx
    dry = [b[0] <= kidx for b in bp]
    hm_bucket = max((pn[lane] if dry[lane] else 0) for lane in range(32)) & ~kidx
    exact = hm_bucket >= last_bucket
    unordered = False
    collided = False
    if not bucket_exact:
        pair_shared = any(((pms[k] ^ pms[k + 1]) & ~kidx) == 0 for k in range(K - 1))
        head_in_last = [not dry[lane] and (bp[lane][0] & ~kidx) == last_bucket for lane in range(32)]
        if pair_shared or any(head_in_last):
            f = [keys[es[k]] if real[k] else 0 for k in range(K)]
            differs = [((pms[k] ^ pms[k + 1]) & ~kidx) == 0 and f[k] != f[k + 1] for k in range(K - 1)]
            # Two picks of one bucket with different keys: in the last pick's bucket the exact rounds
            # run; above it every candidate of the bucket is a pick, so sorting the picks repairs it.
            bad = any(d and (pms[k] & ~kidx) == last_bucket for k, d in enumerate(differs))
            unordered = any(differs)
            for lane in range(32):
                if head_in_last[lane]:
                    b = bp[lane]
                    alone = (D < 2 or (b[1] & ~kidx) != last_bucket) and (pn[lane] & ~kidx) != last_bucket
                    if not alone or keys[kidx - (b[0] & kidx)] != f[K - 1]:
                        bad = True
            collided = bad
            exact = exact or bad
    truth = sorted((e for e in range(kmax) if keys[e] != 0), key=lambda e: (-keys[e], e))[:K]
    if unordered:  # the picks sorted by (key desc, expert asc)
        es = sorted(es, key=lambda e: (-keys[e], e))
    if bucket_rounds and collided and hm_bucket < last_bucket:
        # Bucket rounds (route_warp's whole-warp rows): picks rb .. K - 1 are the last pick's bucket's
        # best candidates by full key; each lane ranks its keys of that bucket by (low bits, inverted
        # expert) and rescans below the round's pick only when it gave it and held another.
        rb = next(k for k in range(K) if (keys[es[k]] & ~kidx) == last_bucket)

        def bucket_best(lane, thr):
            ms = []
            for j in range(4 * S):
                i, c = divmod(j, 4)
                e = 128 * i + 4 * lane + c
                if (keys[e] & ~kidx) == last_bucket:
                    m = (1 << 31) | ((keys[e] & kidx) << bits) | (kidx - e)
                    if m < thr:
                        ms.append(m)
            return (max(ms) if ms else 0), len(ms) > 1

        lanes = [list(bucket_best(lane, 0xFFFFFFFF)) for lane in range(32)]
        for k in range(rb, K):
            pm = max(m for m, _ in lanes)
            assert pm != 0
            es[k] = kidx - (pm & kidx)
            for lane in range(32):
                if lanes[lane][0] == pm:
                    lanes[lane] = list(bucket_best(lane, pm)) if lanes[lane][1] else [0, False]
        assert es == truth, (E, K, rb, es, truth)
        return "bucket"
    if exact:
        # The exact rounds keep the picks whose key is above every doubt: above the largest hidden
        # bucket and, after a collision (a doubt within the last pick's bucket), above that bucket.
        bound = (max(hm_bucket, last_bucket) if collided else hm_bucket) | kidx
        f = [keys[e] if real[k] else 0 for k, e in enumerate(es)]
        r0 = next((k for k in range(K) if f[k] <= bound), K)
        assert es[:r0] == truth[:r0], (E, K, r0, es, truth)
        return ("collided" if collided else "exact") + (" from %d of %d" % (r0, K) if stats_detail else "")
    assert es == truth, (E, K, es, truth)
    return "sorted" if unordered else "fast"


def make_keys(kind, E, rng):
    S = (E + 127) // 128
    v = [rng.gauss(0, 1) for _ in range(E)]
    if kind == "near":  # values a few hundred ulps apart
        base = rng.gauss(1, 1)
        v = [struct.unpack("<f", struct.pack("<I", fbits(base) + rng.randint(-600, 600)))[0]
             if rng.random() < 0.5 else x for x in v]
    elif kind == "nearties":  # 2-48 experts within 1-4 ulps of a base: exact ties in one bucket
        base = fbits(4.5 + 0.25 * rng.randrange(8))  # above the N(0, 1) values
        spread = rng.choice([2, 3, 4])
        for _ in range(rng.choice([2, 3, 4, 6, 8, 16, 48])):
            v[rng.randrange(E)] = struct.unpack("<f", struct.pack("<I", base + rng.randrange(spread)))[0]
    elif kind == "hidden":  # as tests/routing Kind::kHiddenInBucket: the check's 'alone' test
        v = [x - 4.0 for x in v]
        x = 3.0
        above = struct.unpack("<f", struct.pack("<I", fbits(x) + 1))[0]
        l1 = rng.randrange(31)
        l2 = l1 + 1 + rng.randrange(31 - l1)
        v[4 * l1] = x
        if rng.random() < 0.5:
            v[4 * l2 + 1], v[4 * l2 + 2] = x, above
        else:
            v[4 * l2], v[4 * l2 + 1], v[4 * l2 + 2], v[4 * l2 + 3] = 5.0, x, above, above
    elif kind == "ties":
        v = [float(rng.randint(-3, 3)) for _ in range(E)]
    elif kind == "lane":  # the best values in one lane's experts
        lane = rng.randrange(32)
        for i in range(S):
            for c in range(4):
                e = 128 * i + 4 * lane + c
                if e < E:
                    v[e] = 5 + rng.random() * 1e-3
    elif kind == "bf16":
        v = [bf16(x) for x in v]
    elif kind == "bf16ties":
        v = [bf16(rng.choice([0.5, 0.25, -0.5, 1.0, rng.gauss(0, 1)])) for _ in range(E)]
    elif kind == "inf":
        for _ in range(rng.randint(1, 12)):
            v[rng.randrange(E)] = rng.choice([float("inf"), float("-inf"), float("nan")])
    keys = [score_key(x) for x in v] + [0] * (128 * S - E)
    if kind in ("group", "lane"):  # keep half of the groups: the others are key 0
        g = rng.choice([8, 16])
        if E % g == 0:
            size = E // g
            keep = set(rng.sample(range(g), max(1, g // 2)))
            keys = [k if (e < E and (e // size) in keep) else 0 for e, k in enumerate(keys)]
    return keys


def main():
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    stats = {}
    for _ in range(rows):
        E = rng.choice([72, 128, 160, 256, 257, 384, 500, 512, 640, 1000, 2048])
        kind = rng.choice(["rand", "near", "nearties", "hidden", "ties", "lane", "bf16", "bf16ties", "inf", "group"])
        if kind == "hidden":
            E = rng.choice([128, 256, 384, 512])
        keys = make_keys(kind, E, rng)
        K = rng.randint(1, 3) if kind == "hidden" else rng.randint(1, min(32, sum(1 for k in keys if k)))
        r = route(keys, E, K, bucket_exact=kind.startswith("bf16"))
        stats[(kind, r)] = stats.get((kind, r), 0) + 1
    for k in sorted(stats):
        print(*k, stats[k])
    print(f"{rows} rows: every accepted fast pass was exact")


if __name__ == "__main__":
    main()
