"""Fashion-MNIST (Zalando): MNIST's format and shapes, ten kinds of clothing instead of digits.

Not shipped with the package (30 MB). ``load`` reads, in this order: ``root=``, the folder in
``$ENGINE_FASHION_MNIST_DIR``, or Debian's ``dataset-fashion-mnist`` package location
``/usr/share/datasets/fashion-mnist``. ``download()`` fetches the upstream files into a
cache folder for users with internet access.
"""
import os

from data.download import cache_dir, download as download_files
from data.mnist import TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS, read_set

ENV_VAR = "ENGINE_FASHION_MNIST_DIR"
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
UPSTREAM_URL = ("https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/"
                "data/fashion/")
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

# sha256 of the upstream .gz files (their md5 is in the upstream README; these digests are
# the ones torchvision and other loaders publish for the same files)
UPSTREAM_SHA256 = {
    TRAIN_IMAGES + ".gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
    TRAIN_LABELS + ".gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
    TEST_IMAGES + ".gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
    TEST_LABELS + ".gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
}
# sha256 of the decompressed IDX files, whatever recompressed them (Debian's package ships
# its own .gz bytes). The label digests were computed from the upstream .gz files at
# zalandoresearch/fashion-mnist b2617bb; the image digests are the Git LFS object ids of
# the unpacked files in a torchvision download (whose .gz object ids equal the upstream
# digests above, and whose sizes are 16 + N * 784 bytes)
RAW_SHA256 = {
    TRAIN_IMAGES: "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    TRAIN_LABELS: "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    TEST_IMAGES: "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    TEST_LABELS: "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
KNOWN_SHA256 = {name: {digest} for name, digest in {**UPSTREAM_SHA256, **RAW_SHA256}.items()}

HOW_TO_GET_IT = (
    "get it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or put the four "
    f"upstream files ({', '.join(UPSTREAM_SHA256)}, from "
    "https://github.com/zalandoresearch/fashion-mnist) in a folder and pass it as root= "
    "(the CLI: --data-dir) "
    f"(or set ${ENV_VAR}), or call data.fashion_mnist.download() when you have internet access"
)


def load(root=None, verify=False):
    """``(x_train, y_train), (x_test, y_test)``: uint8 images ``[N, 28, 28]`` and labels ``[N]``
    (class names in ``CLASSES``). ``verify=True`` checks each file's sha256: a .gz passes
    when its bytes are the upstream file's or its decompressed content is the upstream
    content (so Debian's recompressed files pass), a raw file when it is that content."""
    folder = root if root is not None else os.environ.get(ENV_VAR) or DEBIAN_DIR
    return read_set(folder, "Fashion-MNIST", KNOWN_SHA256 if verify else None,
                    missing_hint=HOW_TO_GET_IT)


def download(folder=None, base_url=UPSTREAM_URL, timeout=60):
    """Fetch the upstream files into ``folder`` (a user cache folder by default), verified by
    sha256; returns the folder, ready for ``load(root=folder)``."""
    folder = folder if folder is not None else cache_dir("fashion-mnist")
    return download_files(base_url, UPSTREAM_SHA256, folder, timeout)
