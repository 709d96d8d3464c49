"""The LM head fused with its cross-entropy in chunks of rows: loss and gradients without the (B*T, vocab) logits."""

import torch


class ChunkedLMHeadLoss(torch.autograd.Function):
    """mean over rows of cross_entropy(h @ weight.T, targets), computed chunk_rows rows at a time.

    Per chunk: the logits in the matmul dtype (autocast's, as nn.Linear would give them), the
    log-softmax in fp32 (as F.cross_entropy(logits.float(), ...)), and at once the gradient of the
    mean loss wrt the logits, softmax - one_hot over the number of rows, from which the chunk's
    gradients wrt h and weight follow; then the chunk's logits are dropped. Backward only scales
    the stored gradients by the loss's incoming gradient. Memory: one chunk's logits (and their fp32
    copy) instead of all of them, plus a gradient the size of h and one of weight (fp32)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_rows):
        # the dtype autocast gives the LM head's matmul, else the inputs' own
        dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else h.dtype
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(dtype)
            n = h.size(0)
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
            loss = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, n, chunk_rows):
                hc = h[start : start + chunk_rows].to(dtype)
                yc = targets[start : start + chunk_rows]
                logits = (hc @ w.t()).float()  # (rows, vocab): this chunk's only
                lse = torch.logsumexp(logits, dim=-1)
                loss += (lse - logits.gather(1, yc[:, None]).squeeze(1)).sum()
                if need_h or need_w:
                    # d(mean loss)/d(logits) = (softmax - one_hot) / n, in the matmul dtype as in autocast's backward
                    g = torch.exp(logits.sub_(lse[:, None]))
                    g.scatter_add_(1, yc[:, None], torch.full_like(lse[:, None], -1.0))
                    g = g.div_(n).to(dtype)
                    if need_h:
                        grad_h[start : start + chunk_rows] = g @ w
                    if need_w:
                        grad_w += (g.t() @ hc).float()
                del logits
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = None if grad_h is None else grad_h * grad_loss
        grad_w = None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None


def chunked_cross_entropy(h, weight, targets, chunk_rows=4096):
    """F.cross_entropy((h @ weight.T).float(), targets) for h (N, C), weight (vocab, C), targets (N,),
    never holding more than chunk_rows rows of logits."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, not {chunk_rows}")
    return ChunkedLMHeadLoss.apply(h, weight, targets, chunk_rows)
