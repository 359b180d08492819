"""The training step the capture tests record: zero the gradients, the cross-entropy loss,
backward, one optimizer step. It returns the loss Tensor, never a host value, so
``engine.capture`` can replay it."""
from engine.losses import cross_entropy


def cross_entropy_step(model, optimizer):
    def step(x, y):
        optimizer.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss
    return step
