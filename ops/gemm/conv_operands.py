"""The convolutions of ``ops.conv`` as implicit GEMMs: their geometry (``ConvGeometry``), the
GEMM shape of each mode (``conv_gemm_shape``), and what the template takes from them: the
fetches that gather a tile's operands from the flat NCHW arrays (``conv_operands``) and the
entry point whose epilogue stores NCHW (``conv_entry``)."""
from collections import namedtuple

from numba import uint64 as U

from ops.cuda import cuda
from ops.gemm.tilings import CONV_FORWARD, CONV_GRAD_INPUT, CONV_GRAD_WEIGHT
from ops.pointwise import value_cuda


# The geometry of a convolution (ops.conv's notation, the batch excepted: it is read from the
# arrays' sizes, so a short last batch reuses the kernels). Its values are compile-time
# constants of the kernels, as a tiling's are: the divisions that take a GEMM row or column
# apart into (sample, row, column) or (channel, tap) become multiplications. BIAS: the forward
# adds a bias; the weight gradient appends a column of ones to B, whose output column is db.
ConvGeometry = namedtuple("ConvGeometry", "C H W O OH OW KH KW SH SW PT PL DH DW GROUPS BIAS")


def conv_gemm_shape(mode, geometry, batch):
    """(M, N, K) of one group's GEMM. Positions (sample, row, column) are the output columns
    of the forward and dx, so the epilogue's NCHW stores run along a row of the image:
    - forward: y[o, p] = Σ_k w[o, k] · X[k, p], K = (c, i, j) of Cg·KH·KW, p = (n, oh, ow);
    - dx: dx[c, p] = Σ_k W[c, k] · G[k, p], k = (o, i, j) of Og·KH·KW (the flipped filter:
      G[k, p] is grad_out at the output position that tap (i, j) of p's input position
      feeds, zero where none does), p = (n, ih, iw);
    - dw: dw[o, k] = Σ_p G[o, p] · X[p, k] over the N·OH·OW positions p, k = (c, i, j), and
      with BIAS one more column of ones: db[o] = Σ_p G[o, p]."""
    g = geometry
    taps = g.KH * g.KW
    cg, og = g.C // g.GROUPS, g.O // g.GROUPS
    if mode == CONV_FORWARD:
        return og, batch * g.OH * g.OW, cg * taps
    if mode == CONV_GRAD_INPUT:
        return cg, batch * g.H * g.W, og * taps
    return og, cg * taps + (1 if g.BIAS else 0), batch * g.OH * g.OW


def conv_operands(conv, mode, numba_type, A_LOADS, B_LOADS, a_slot, b_slot):
    """The fetches of a CONV_ mode: each loads the thread's elements of the next A or B
    K-slice, gathered from the convolution's flat NCHW arrays, zero outside the image (the
    padding) and outside the GEMM. Unsigned arithmetic throughout (as the template's), so a
    padded row ``oh·SH + i·DH`` is compared with PT before PT is taken off: it never
    wraps. ``group`` is the block's group: its channels and filters."""
    C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, BIAS = conv
    TAPS, CG, OG = KH * KW, C // GROUPS, O // GROUPS
    P_OUT, P_IN, NK = OH * OW, H * W, C // GROUPS * KH * KW
    ZERO, ONE = numba_type(0), numba_type(1)

    @cuda.jit(device=True)
    def image_tap(x, p, k, group):
        """x at tap k = (c, i, j) of output position p = (n, oh, ow): X[k, p] of the forward,
        X[p, k] of dw."""
        n, q = p // U(P_OUT), p % U(P_OUT)
        c, t = k // U(TAPS), k % U(TAPS)
        ih = (q // U(OW)) * U(SH) + (t // U(KW)) * U(DH)   # in the padded image
        iw = (q % U(OW)) * U(SW) + (t % U(KW)) * U(DW)
        if U(PT) <= ih < U(PT + H) and U(PL) <= iw < U(PL + W):
            return x[((n * U(C) + group * U(CG) + c) * U(H) + ih - U(PT)) * U(W) + iw - U(PL)]
        return ZERO

    @cuda.jit(device=True)
    def gradient_at(p, o, group):
        """The flat index of grad_out (and y) at output position p = (n, q) and the group's
        filter o."""
        return ((p // U(P_OUT)) * U(O) + group * U(OG) + o) * U(P_OUT) + p % U(P_OUT)

    @cuda.jit(device=True)
    def fetch_a(a, aux, regs, aux_regs, k0, row0, m_data, k_end, tid, group, fast):
        for load in range(A_LOADS):
            kk, r = a_slot(tid, load)
            m, k = row0 + r, k0 + kk
            value = y = ZERO
            if k < k_end and m < m_data:
                if mode == CONV_FORWARD:   # w as (O, Cg·KH·KW)
                    value = a[(group * U(OG) + m) * U(NK) + k]
                elif mode == CONV_GRAD_INPUT:   # w[g·Og + o, c, i, j] with k = (o, i, j)
                    value = a[((group * U(OG) + k // U(TAPS)) * U(CG) + m) * U(TAPS)
                              + k % U(TAPS)]
                else:   # grad_out and y at position k of filter m
                    at = gradient_at(k, m, group)
                    value = a[at]
                    y = aux[at]
            regs[load] = value
            aux_regs[load if mode == CONV_GRAD_WEIGHT else 0] = y

    @cuda.jit(device=True)
    def fetch_b(b, aux, regs, aux_regs, k0, col0, n_size, k_end, tid, group, fast):
        for load in range(B_LOADS):
            kk, c = b_slot(tid, load)
            n, k = col0 + c, k0 + kk
            value = y = ZERO
            if k < k_end and n < n_size:
                if mode == CONV_FORWARD:
                    value = image_tap(b, n, k, group)
                elif mode == CONV_GRAD_INPUT:   # the output position tap k = (o, i, j) of n reads
                    q, o, t = n % U(P_IN), k // U(TAPS), k % U(TAPS)
                    ph, pw = q // U(W) + U(PT), q % U(W) + U(PL)   # in the padded image
                    i, j = (t // U(KW)) * U(DH), (t % U(KW)) * U(DW)
                    th, tw = ph - i if ph >= i else U(SH * OH), pw - j if pw >= j else U(SW * OW)
                    oh, ow = th // U(SH), tw // U(SW)
                    if oh < U(OH) and ow < U(OW) and th % U(SH) == U(0) and tw % U(SW) == U(0):
                        at = gradient_at((n // U(P_IN)) * U(P_OUT) + oh * U(OW) + ow, o, group)
                        value = b[at]
                        y = aux[at]
                elif n < U(NK):
                    value = image_tap(b, k, n, group)
                else:   # dw's column of ones: its output column is db
                    value = ONE
            regs[load] = value
            aux_regs[load if mode == CONV_GRAD_INPUT else 0] = y

    return fetch_a, fetch_b


def conv_entry(conv, mode, partial, act, entry, accumulate, k_range, acc_position, tiling,
                numba_type):
    """The ``@cuda.jit`` entry point of a CONV_ mode: block (x, y) takes a tile of one
    group's GEMM, block z its group and K slice (z = slice·GROUPS + group), and the epilogue
    writes NCHW (forward: bias and activation fused; dx), dw and db, or a split-K partial."""
    C, H, W, O, OH, OW, KH, KW, SH, SW, PT, PL, DH, DW, GROUPS, BIAS = conv
    TAPS, CG, OG = KH * KW, C // GROUPS, O // GROUPS
    P_OUT, P_IN, NK = OH * OW, H * W, C // GROUPS * KH * KW
    BM, BN, BK, TM, TN = tiling[:5]
    ACC = (TM, TN)
    COLUMNS = NK + (1 if BIAS else 0)   # dw's columns, db's included

    @cuda.jit(device=True)
    def conv_tile_product(a, b, out, aux, side, bias, alpha):
        acc = cuda.local.array(ACC, numba_type)
        tid = U(cuda.threadIdx.x)
        row0, col0 = U(cuda.blockIdx.y) * U(BM), U(cuda.blockIdx.x) * U(BN)
        z = U(cuda.blockIdx.z)
        group, slice_index = z % U(GROUPS), z // U(GROUPS)
        if mode == CONV_FORWARD:   # out is y: N·O·OH·OW
            m_data, n_size, k_size = U(OG), U(out.shape[0]) // U(O), U(NK)
        elif mode == CONV_GRAD_INPUT:   # out is dx: N·C·H·W
            m_data, n_size, k_size = U(CG), U(out.shape[0]) // U(C), U(OG * TAPS)
        else:   # a is grad_out: N·O·OH·OW
            m_data, n_size, k_size = U(OG), U(COLUMNS), U(a.shape[0]) // U(O)
        k_begin, k_end = k_range(k_size, slice_index, U(cuda.gridDim.z) // U(GROUPS))
        accumulate(a, b, aux, acc, row0, col0, m_data, n_size, k_begin, k_end, group, alpha)
        for i in range(TM):
            for j in range(TN):
                r, c = acc_position(tid, i, j)
                m, n = row0 + r, col0 + c
                if m < m_data and n < n_size:
                    value = acc[i, j]
                    if mode == CONV_FORWARD:
                        o = group * U(OG) + m
                        if BIAS:
                            value += bias[o]
                        out[((n // U(P_OUT)) * U(O) + o) * U(P_OUT) + n % U(P_OUT)] = \
                            value_cuda(act, value, alpha)
                    elif mode == CONV_GRAD_INPUT:
                        out[((n // U(P_IN)) * U(C) + group * U(CG) + m) * U(P_IN)
                            + n % U(P_IN)] = value
                    elif partial:   # partials: (slices, O, COLUMNS)
                        out[(slice_index * U(O) + group * U(OG) + m) * U(COLUMNS) + n] = value
                    elif n < U(NK):
                        out[(group * U(OG) + m) * U(NK) + n] = value
                    else:
                        side[group * U(OG) + m] = value

    if mode == CONV_FORWARD:
        @entry
        def conv2d_forward_gemm_cuda(x, w, bias, out, alpha):
            conv_tile_product(w, x, out, x, bias, bias, alpha)
        return conv2d_forward_gemm_cuda
    if mode == CONV_GRAD_INPUT:
        @entry
        def conv2d_grad_input_gemm_cuda(w, grad_out, y, grad_x, alpha):
            conv_tile_product(w, grad_out, grad_x, y, grad_x, grad_x, alpha)
        return conv2d_grad_input_gemm_cuda
    if partial:
        @entry
        def conv2d_grad_weight_partial_cuda(grad_out, y, x, partials, alpha):
            conv_tile_product(grad_out, x, partials, y, partials, partials, alpha)
        return conv2d_grad_weight_partial_cuda

    @entry
    def conv2d_grad_weight_gemm_cuda(grad_out, y, x, grad_w, grad_b, alpha):
        conv_tile_product(grad_out, x, grad_w, y, grad_b, grad_b, alpha)
    return conv2d_grad_weight_gemm_cuda
