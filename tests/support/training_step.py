"""The training step the capture tests record: zero the gradients, the loss, backward, one
optimizer step. It returns the loss Tensor, never a host value, so ``engine.capture`` can
replay it."""
from engine.losses import cross_entropy


def training_step(optimizer, loss_of, before_step=None):
    """``step(*batch)``: the step of the loss ``loss_of(*batch)``; ``before_step()``, when
    given, runs between the backward and the optimizer's step (a test's way to raise there)."""
    def step(*batch):
        optimizer.zero_grad()
        loss = loss_of(*batch)
        loss.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        return loss
    return step


def cross_entropy_step(model, optimizer, loss_fn=cross_entropy, before_step=None):
    """``step(x, y)`` of ``loss_fn(model(x), y)``: the cross-entropy function, or
    ``nn.CrossEntropyLoss()``."""
    return training_step(optimizer, lambda x, y: loss_fn(model(x), y), before_step)
