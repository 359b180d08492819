import engine
from engine import nn, optim
from data import DataLoader, mnist

(x_train, y_train), (x_test, y_test) = mnist.load()   # Fashion-MNIST is not shipped: MNIST
training_data, test_data = (x_train[:, None], y_train), (x_test[:, None], y_test)

batch_size = 64
train_dataloader = DataLoader(*training_data, batch_size=batch_size)
test_dataloader = DataLoader(*test_data, batch_size=batch_size)

device = "cpu"
print(f"Using {device} device")

class NeuralNetwork(nn.Model):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Dense(512),
            nn.Activation("relu"),
            nn.Dense(512),
            nn.Activation("relu"),
            nn.Dense(10)
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits

model = NeuralNetwork().to(device)
model.build((1, 28, 28))
print(model)

loss_fn = nn.CrossEntropyLoss()
optimizer = optim.SGD(model.parameters(), lr=1e-3)

def train(dataloader, model, loss_fn, optimizer):
    size = dataloader.num_samples
    model.train()
    for batch, (X, y) in enumerate(dataloader):
        X, y = X.to(device), y.to(device)
        pred = model(X)
        loss = loss_fn(pred, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if batch % 100 == 0:
            loss, current = loss.item(), (batch + 1) * len(X)
            print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")

def test(dataloader, model, loss_fn):
    size = dataloader.num_samples
    num_batches = len(dataloader)
    model.eval()
    test_loss, correct = 0, 0
    with engine.no_grad():
        for X, y in dataloader:
            X, y = X.to(device), y.to(device)
            pred = model(X)
            test_loss += loss_fn(pred, y).item()
            correct += (pred.argmax(1) == y).float().sum().item()
    test_loss /= num_batches
    correct /= size
    print(f"Test Error: \n Accuracy: {(100*correct):>0.1f}%, Avg loss: {test_loss:>8f} \n")

epochs = 5
for t in range(epochs):
    print(f"Epoch {t+1}\n-------------------------------")
    train(train_dataloader, model, loss_fn, optimizer)
    test(test_dataloader, model, loss_fn)
print("Done!")
