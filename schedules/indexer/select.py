"""The exact top-k selection over bf16 score rows: order keys, radix histogram, in-order emit."""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

NEG_KEY = 0x007F  # order key of bf16 -inf
POS_INF_KEY = 0xFF80  # order key of bf16 +inf (the pinned newest block)


def _key(v):
    """bf16 value -> uint32 order key (larger key = larger value; -0 and +0 equal)."""
    u = T.Cast("uint32", T.reinterpret("uint16", v))
    return T.Select(u == T.uint32(0x8000), T.uint32(0x8000),
                    T.Select(u >= T.uint32(0x8000), T.uint32(0xFFFF) - u, u + T.uint32(0x8000)))


# ---- selection -------------------------------------------------------------------------------


def make_select(*, topk: int, kind: str = "positions", block_size: int = 1, lanes: int = 1,
                gpu: bool = False, group: int = 64, chunks: int = 32) -> tvm.tirx.PrimFunc:
    """Exact top-k over bf16 score rows: ties to the lower index, -inf dropped, ascending output,
    -1 padded. `kind`:

    - "positions": (scores [b, s, P]) -> positions int32 [b, s, topk]
    - "blocks":    (scores [b, s, P], lens [b, s]) -> candidate blocks int32 [b, s, topk]; block
                   score = max over its block_size entries, the block of entry lens-1 pinned to
                   +inf (needs lens <= T, as the model guarantees)
    - "pool":      (scores [b, s, P], blocks [b, s, B]) -> positions int32 [b, s, topk] where entry
                   j is position blocks[j // bs] * bs + j % bs (needs the ascending, duplicate-free,
                   -1-at-the-end block lists that "blocks" produces, so entry order = position
                   order)

    CPU (`gpu=False`, `lanes` unused): first, in parallel over (row, run of groups; `chunks`
    runs per row), each group's largest key (`group` items, vectorised); then, one task per
    row, the k-th largest group
    maximum m: every entry that can be selected lies in a group whose maximum is >= m (k groups
    hold an entry >= m, so the k-th largest entry is >= m), so the exact radix selection and the
    in-order emit only visit those groups (about k * group entries instead of the whole row).
    With `gpu=True` a thread block of `lanes` threads shares a row (shared-memory histograms
    with atomics, then an ordered emit over contiguous per-thread segments).
    """
    if kind not in ("positions", "blocks", "pool"):
        raise ValueError(f"kind must be positions, blocks or pool; got {kind!r}.")
    if topk <= 0 or block_size <= 0 or lanes <= 0:
        raise ValueError("topk, block_size and lanes must be positive.")
    if gpu and (lanes & (lanes - 1) or lanes > 1024):
        raise ValueError(f"lanes must be a power of two up to 1024 on GPU; got {lanes}.")
    if group <= 0 or group % 16:
        raise ValueError(f"group must be a positive multiple of 16; got {group}.")
    if chunks <= 0:
        raise ValueError(f"chunks must be positive; got {chunks}.")
    return _make_select(topk, kind, block_size, lanes, gpu, group, chunks)


def _make_select(topk: int, kind: str, block_size: int, lanes: int, gpu: bool, group: int,
                 chunks: int):
    K = T.int64(topk)
    G = T.int64(group)
    NCH = T.int64(chunks)
    BS = T.int64(block_size)
    NT = T.int64(lanes)
    NEG = T.uint32(NEG_KEY)

    def n_items(p):  # entries scanned per row: scores, or blocks of scores
        return (p + BS - T.int64(1)) // BS if kind == "blocks" else p

    def key(S, A, vb, vs, i, p):
        if kind != "blocks":
            return _key(S[vb, vs, i])
        best = NEG
        for e in range(block_size):  # block max over its entries (-inf past the row)
            at = i * BS + T.int64(e)
            best = T.max(best, T.Select(at < p, _key(S[vb, vs, T.min(at, p - T.int64(1))]), NEG))
        pinned = T.floordiv(A[vb, vs] - T.int64(1), BS) == i  # block of the newest entry
        return T.Select(pinned, T.uint32(POS_INF_KEY), best)

    def pos(A, vb, vs, i):
        if kind != "pool":
            return T.Cast("int32", i)
        return A[vb, vs, i // BS] * T.int32(block_size) + T.Cast("int32", i % BS)

    @T.macro
    def find_bin(hist, st):
        # st[0] <- the bin (from the top) where the running count reaches K, else -1;
        # st[1] += the count in the bins above it. st is local: the CUDA storage-sync pass
        # rejects shared-memory loads in branch conditions, hence the copy into st[7].
        st[0] = T.int64(-1)
        for j in range(256):
            st[7] = T.Cast("int64", hist[255 - j])
            if st[0] < T.int64(0):
                if st[1] + st[7] >= K:
                    st[0] = T.int64(255 - j)
                else:
                    st[1] = st[1] + st[7]

    @T.macro
    def set_threshold(st):
        # st[2] threshold key, st[3] ties to take; no bin reached K -> take every finite entry
        if st[0] < T.int64(0):
            st[2] = T.int64(NEG_KEY)
            st[3] = T.int64(0)
        else:
            st[2] = st[4] * T.int64(256) + st[0]
            st[3] = K - st[1]

    def n_groups(p):
        return (n_items(p) + G - T.int64(1)) // G

    def per_chunk(p):  # groups per parallel run of the group-maximum pass
        return (n_groups(p) + NCH - T.int64(1)) // NCH

    def item_key(S, A, vb, vs, i, p):  # key of item i, NEG past the row
        return T.Select(i < n_items(p), key(S, A, vb, vs, T.min(i, n_items(p) - T.int64(1)), p),
                        NEG)

    @T.macro
    def group_max(S, A, GM, r, vb, vs, g, p):
        lm = T.alloc_buffer((16,), "uint32", scope="local")  # per-lane maxima
        for lane in T.vectorized(16):
            lm[lane] = NEG
        if g * G + G <= n_items(p):  # a whole group: plain vector loads
            for j in range(G // T.int64(16)):
                for lane in T.vectorized(16):
                    lm[lane] = T.max(lm[lane], key(S, A, vb, vs, g * G + j * T.int64(16) + lane,
                                                   p))
        else:
            for j in range(G // T.int64(16)):
                for lane in T.vectorized(16):
                    lm[lane] = T.max(lm[lane], item_key(S, A, vb, vs,
                                                        g * G + j * T.int64(16) + lane, p))
        for lane in T.vectorized(8):  # a max tree over the lanes
            lm[lane] = T.max(lm[lane], lm[lane + 8])
        for lane in T.vectorized(4):
            lm[lane] = T.max(lm[lane], lm[lane + 4])
        for lane in T.vectorized(2):
            lm[lane] = T.max(lm[lane], lm[lane + 2])
        GM[r, g] = T.max(lm[0], lm[1])

    @T.macro
    def group_keys(S, A, kb, vb, vs, g, p):
        if g * G + G <= n_items(p):
            for j in T.vectorized(G):
                kb[j] = key(S, A, vb, vs, g * G + j, p)
        else:
            for j in T.vectorized(G):
                kb[j] = item_key(S, A, vb, vs, g * G + j, p)

    @T.macro
    def row_cpu(S, A, OUT, GM, r, vb, vs, p):
        hist = T.alloc_buffer((256,), "int32", scope="local")
        st = T.alloc_buffer((8,), "int64", scope="local")
        cut = T.alloc_buffer((1,), "uint32", scope="local")
        kb = T.alloc_buffer((G,), "uint32", scope="local")  # one group's keys
        # the k-th largest group maximum (NEG when fewer than k groups hold a finite key)
        for j in range(256):
            hist[j] = 0
        for g in range(n_groups(p)):
            if GM[r, g] > NEG:
                hist[T.Cast("int32", GM[r, g] >> T.uint32(8))] += 1
        st[1] = T.int64(0)
        find_bin(hist, st)
        st[4] = st[0]
        if st[4] >= T.int64(0):
            for j in range(256):
                hist[j] = 0
            for g in range(n_groups(p)):
                if (GM[r, g] > NEG) and (T.Cast("int64", GM[r, g] >> T.uint32(8)) == st[4]):
                    hist[T.Cast("int32", GM[r, g] & T.uint32(255))] += 1
            find_bin(hist, st)
        set_threshold(st)
        cut[0] = T.max(T.Cast("uint32", st[2]), NEG + T.uint32(1))
        # the exact threshold (two radix passes) over the items >= cut of the candidate groups
        # only: the k-th largest item is >= cut, so every bin at or above its bin is counted
        # in full; a group's keys are computed vectorised, once per pass
        for j in range(256):
            hist[j] = 0
        for g in range(n_groups(p)):
            if GM[r, g] >= cut[0]:
                group_keys(S, A, kb, vb, vs, g, p)
                for j in range(G):
                    if kb[j] >= cut[0]:
                        hist[T.Cast("int32", kb[j] >> T.uint32(8))] += 1
        st[1] = T.int64(0)
        find_bin(hist, st)
        st[4] = st[0]
        if st[4] >= T.int64(0):
            for j in range(256):
                hist[j] = 0
            for g in range(n_groups(p)):
                if GM[r, g] >= cut[0]:
                    group_keys(S, A, kb, vb, vs, g, p)
                    for j in range(G):
                        if (kb[j] >= cut[0]) and (T.Cast("int64", kb[j] >> T.uint32(8))
                                                  == st[4]):
                            hist[T.Cast("int32", kb[j] & T.uint32(255))] += 1
            find_bin(hist, st)
        set_threshold(st)
        # emit in position order: every item above the threshold, then the first ties
        st[5] = T.int64(0)  # emitted
        st[6] = T.int64(0)  # ties seen
        for g in range(n_groups(p)):
            if GM[r, g] >= cut[0]:
                group_keys(S, A, kb, vb, vs, g, p)
                for j in range(G):
                    if kb[j] >= cut[0]:
                        if T.Cast("int64", kb[j]) > st[2]:
                            OUT[vb, vs, st[5]] = pos(A, vb, vs, g * G + j)
                            st[5] = st[5] + T.int64(1)
                        elif T.Cast("int64", kb[j]) == st[2]:
                            if st[6] < st[3]:
                                OUT[vb, vs, st[5]] = pos(A, vb, vs, g * G + j)
                                st[5] = st[5] + T.int64(1)
                            st[6] = st[6] + T.int64(1)
        for j in range(K):
            if j >= st[5]:
                OUT[vb, vs, j] = -1

    @T.macro
    def row_gpu(S, A, OUT, vb, vs, p):
        hist = T.alloc_buffer((256,), "int32", scope="shared")
        # lane 0's results, broadcast; one buffer per phase so that no shared buffer is both
        # read and written inside a branch (ThreadSync cannot place a barrier there)
        sh_a = T.alloc_buffer((2,), "int64", scope="shared")
        sh_b = T.alloc_buffer((2,), "int64", scope="shared")
        sh_c = T.alloc_buffer((1,), "int64", scope="shared")
        cnt = T.alloc_buffer((lanes * 2,), "int64", scope="shared")  # [gt | eq] per lane
        pre = T.alloc_buffer((lanes * 2,), "int64", scope="shared")  # exclusive prefix of cnt
        st = T.alloc_buffer((8,), "int64", scope="local")  # as in row_cpu
        loc = T.alloc_buffer((4,), "int64", scope="local")
        for tx in T.thread_binding(NT, thread="threadIdx.x"):
            for j in range((256 + lanes - 1) // lanes):
                if j * lanes + tx < 256:
                    hist[j * lanes + tx] = 0
            T.tvm_storage_sync("shared")
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if j * NT + tx < n_items(p):
                    if key(S, A, vb, vs, j * NT + tx, p) > NEG:
                        T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist[
                            T.Cast("int32", key(S, A, vb, vs, j * NT + tx, p) >> T.uint32(8))]),
                            1))
            T.tvm_storage_sync("shared")
            if tx == 0:
                st[1] = T.int64(0)
                find_bin(hist, st)
                sh_a[0] = st[0]
            T.tvm_storage_sync("shared")
            st[4] = sh_a[0]
            for j in range((256 + lanes - 1) // lanes):
                if j * lanes + tx < 256:
                    hist[j * lanes + tx] = 0
            T.tvm_storage_sync("shared")
            if st[4] >= T.int64(0):
                for j in range((n_items(p) + NT - T.int64(1)) // NT):
                    if j * NT + tx < n_items(p):
                        if (key(S, A, vb, vs, j * NT + tx, p) > NEG) and (T.Cast(
                                "int64", key(S, A, vb, vs, j * NT + tx, p) >> T.uint32(8))
                                == st[4]):
                            T.evaluate(T.call_extern("int32", "atomicAdd", T.address_of(hist[
                                T.Cast("int32", key(S, A, vb, vs, j * NT + tx, p)
                                       & T.uint32(255))]), 1))
            T.tvm_storage_sync("shared")
            if tx == 0:  # st[0:2] still hold lane 0's first-pass results
                if st[4] >= T.int64(0):
                    find_bin(hist, st)
                set_threshold(st)
                sh_b[0] = st[2]
                sh_b[1] = st[3]
            T.tvm_storage_sync("shared")
            st[2] = sh_b[0]
            st[3] = sh_b[1]
            # each lane owns a contiguous segment, so lane order = position order
            loc[0] = T.int64(0)
            loc[1] = T.int64(0)
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if tx * ((n_items(p) + NT - T.int64(1)) // NT) + j < n_items(p):
                    if T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) > st[2]:
                        loc[0] = loc[0] + T.int64(1)
                    elif T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) == st[2]:
                        loc[1] = loc[1] + T.int64(1)
            cnt[tx] = loc[0]
            cnt[lanes + tx] = loc[1]
            T.tvm_storage_sync("shared")
            if tx == 0:  # exclusive prefix over lanes; sh_c = entries emitted in total
                st[5] = T.int64(0)
                st[6] = T.int64(0)
                for j in range(lanes):
                    pre[j] = st[5]
                    pre[lanes + j] = st[6]
                    st[5] = st[5] + cnt[j]
                    st[6] = st[6] + cnt[lanes + j]
                sh_c[0] = st[5] + T.min(st[6], st[3])
            T.tvm_storage_sync("shared")
            st[5] = sh_c[0]
            loc[0] = pre[tx] + T.min(pre[lanes + tx], st[3])  # first output slot
            loc[1] = pre[lanes + tx]  # ties before this segment
            for j in range((n_items(p) + NT - T.int64(1)) // NT):
                if tx * ((n_items(p) + NT - T.int64(1)) // NT) + j < n_items(p):
                    if T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) > st[2]:
                        OUT[vb, vs, loc[0]] = pos(
                            A, vb, vs, tx * ((n_items(p) + NT - T.int64(1)) // NT) + j)
                        loc[0] = loc[0] + T.int64(1)
                    elif T.Cast("int64", key(S, A, vb, vs, tx * (
                            (n_items(p) + NT - T.int64(1)) // NT) + j, p)) == st[2]:
                        if loc[1] < st[3]:
                            OUT[vb, vs, loc[0]] = pos(
                                A, vb, vs, tx * ((n_items(p) + NT - T.int64(1)) // NT) + j)
                            loc[0] = loc[0] + T.int64(1)
                        loc[1] = loc[1] + T.int64(1)
            for j in range((topk + lanes - 1) // lanes):
                if j * lanes + tx < topk:
                    if j * lanes + tx >= st[5]:
                        OUT[vb, vs, j * lanes + tx] = -1

    @T.macro
    def rows(S, A, OUT, b, s, p):
        if gpu:
            for r in T.thread_binding(b * s, thread="blockIdx.x"):
                row_gpu(S, A, OUT, r // s, r % s, p)
        else:
            GM = T.alloc_buffer((b * s, n_groups(p)), "uint32")  # group maxima
            for rc in T.parallel(b * s * NCH):  # runs of groups (no divisions per group)
                for gi in range(per_chunk(p)):
                    if rc % NCH * per_chunk(p) + gi < n_groups(p):
                        group_max(S, A, GM, rc // NCH, rc // NCH // s, rc // NCH % s,
                                  rc % NCH * per_chunk(p) + gi, p)
            for r in T.parallel(b * s):
                row_cpu(S, A, OUT, GM, r, r // s, r % s, p)

    if kind == "positions":
        @T.prim_func
        def select_positions(s_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_positions", "tirx.noalias": True})
            b, s, p = T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, S, OUT, b, s, p)

        func = select_positions
    elif kind == "blocks":
        @T.prim_func
        def select_blocks(s_h: T.handle, lens_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_blocks", "tirx.noalias": True})
            b, s, p = T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            L = T.match_buffer(lens_h, (b, s), "int64")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, L, OUT, b, s, p)

        func = select_blocks
    else:
        @T.prim_func
        def select_pool(s_h: T.handle, blocks_h: T.handle, out_h: T.handle):
            T.func_attr({"global_symbol": "select_pool", "tirx.noalias": True})
            b, s, p, nb = T.int64(), T.int64(), T.int64(), T.int64()
            S = T.match_buffer(s_h, (b, s, p), "bfloat16")
            BL = T.match_buffer(blocks_h, (b, s, nb), "int32")
            OUT = T.match_buffer(out_h, (b, s, K), "int32")
            rows(S, BL, OUT, b, s, T.min(p, nb * BS))

        func = select_pool
    return func.with_attr("tirx.is_scheduled", True)
