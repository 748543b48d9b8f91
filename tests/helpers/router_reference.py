"""The slow, obvious router reference the router tests compare against: token by token, Python
sorts, no kernels. Legend: T tokens, E experts, K chosen per token."""
import torch


def score_row(l, score_func):
    return torch.sigmoid(l) if score_func == "sigmoid" else torch.softmax(l, 0)


def slow_route(logits_TE, k, score_func="softmax", normalize=False, scaling=1.0, bias_E=None,
               groups=None, noise_TE=None):
    """Token by token: selection key, group filter, Python sort with (-key, id) order."""
    T, E = logits_TE.shape
    ids, rows = [], []
    for t in range(T):
        l = logits_TE[t]
        ls = l if noise_TE is None else l + noise_TE[t]
        aff = ls if score_func == "softmax_after_topk" else score_row(ls, score_func)
        if bias_E is not None:
            aff = aff + bias_E
        key = (ls if bias_E is None else aff).tolist()
        allowed = list(range(E))
        if groups is not None:
            G, M = groups
            per = E // G
            top = min(per, max(1, k // M))
            a = aff.tolist()
            gscore = [sum(sorted(a[g * per:(g + 1) * per], reverse=True)[:top]) for g in range(G)]
            best = sorted(range(G), key=lambda g: (-gscore[g], g))[:M]
            allowed = [e for e in allowed if e // per in best]
        sel = sorted(allowed, key=lambda e: (-key[e], e))[:k]
        if score_func == "softmax_after_topk":
            w = torch.softmax(l[sel], 0)
        else:
            w = score_row(l, score_func)[sel]
            if normalize:
                w = w / w.sum()
        ids.append(sel)
        rows.append(w * scaling)
    return torch.tensor(ids, dtype=torch.int64).view(T, k), torch.stack(rows) if rows else torch.zeros(0, k)


def slow_aux(logits_TE, ids_TK, k, score_func, seq_len=None):
    """E/K * sum_e f_e P_e (f_e = routes to e / tokens, P_e = mean normalised score),
    averaged over sequences of seq_len tokens for the 'seq' variant."""
    T, E = logits_TE.shape
    L = seq_len or T
    total = 0.0
    for b in range(T // L):
        f = [0.0] * E
        for t in range(b * L, (b + 1) * L):
            for e in ids_TK[t].tolist():
                f[e] += 1.0 / L
        P = 0
        for t in range(b * L, (b + 1) * L):
            s = score_row(logits_TE[t], score_func)
            P = P + (s / s.sum() if score_func == "sigmoid" else s) / L
        total = total + E / k * sum(f[e] * P[e] for e in range(E))
    return total / (T // L)


def slow_z(logits_TE):
    return sum(torch.logsumexp(logits_TE[t], 0) ** 2 for t in range(logits_TE.shape[0])) / logits_TE.shape[0]


def logits_of(router, x):
    b = router.bias
    return torch.stack([(router.weight * x[t].float()).sum(-1) + (0 if b is None else b) for t in range(x.shape[0])])


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)
