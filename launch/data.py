"""Data sets for `launch.train`, and the order in which batches are drawn.

Every loader returns a `Data`: numpy arrays, held in memory, either

- images: x float32 (n, H, W, C) in [0, 1], y int32 (n,) class ids,
- segmentation: x float32 (n, H, W, C) in [0, 1], y int32 (n, H, W) per-pixel
  class ids, or
- text: x int32 (n, seq_len) byte tokens, y int32 (n, seq_len) the next bytes.

Built in, with nothing to download:

- `digits`: scikit-learn's bundled 8x8 digits (1,797 images, 10 classes).
- `digits_masks`: the same digits upscaled to 16x16, with each pixel labelled
  ink (1) or background (0): a segmentation task for the U-Net.
- `pydoc_topics`: the English help texts that ship with Python
  (`pydoc_data.topics`, about 470 kB), as byte tokens (vocabulary 256).

And `tfds:NAME` for any TensorFlow Datasets data set that is already prepared
under a data directory (see `load_tfds`); nothing is ever downloaded.

`BatchOrder` fixes which rows form the batch of every global step, so that a
run resumed from a checkpoint sees exactly the batches the uninterrupted run
would have.
"""

import dataclasses
import math

import numpy as np

TFDS_PREFIX = "tfds:"
TEXT_VOCAB = 256  # byte-level tokens
DEFAULT_SEQ_LEN = 64


@dataclasses.dataclass
class Data:
    """A training and a validation split, in memory.

    Attributes:
      kind: "image", "segmentation" or "text".
      x_train, y_train, x_val, y_val: numpy arrays (see the module docstring).
      num_classes: classes (images) or vocabulary size (text).
      name: where the data came from, for messages.
    """

    kind: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    name: str

    @property
    def image_shape(self):
        return tuple(self.x_train.shape[1:])

    @property
    def seq_len(self):
        return int(self.x_train.shape[1])


def _split(x, y, fraction, seed):
    """A fixed shuffle (default_rng(seed)) then a (1 - fraction, fraction) split."""
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_train = int(round((1 - fraction) * len(x)))
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def load_digits(seed=0, max_examples=0):
    """scikit-learn's bundled digits: 1797 8x8 grey images in [0, 1], 10 classes.

    A fixed shuffle (numpy default_rng(seed)), then an 80/20 split: 1438
    training and 359 validation images, x (n, 8, 8, 1) float32.
    """
    try:
        from sklearn import datasets  # pylint: disable=import-outside-toplevel
    except ImportError as err:
        raise ImportError("The digits data set ships with scikit-learn, which is not "
                          "installed: pip install -e '.[train]' (or scikit-learn).") from err

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    y = digits.target.astype("int32")
    x_train, y_train, x_val, y_val = _split(x, y, 0.2, seed)
    return _cap(Data("image", x_train, y_train, x_val, y_val, 10, "digits"), max_examples)


def load_digits_masks(seed=0, max_examples=0):
    """Digits as segmentation: 16x16 images (each pixel repeated 2x2) and masks.

    The label of a pixel is 1 where the ink is above half its range, else 0,
    so x float32 (n, 16, 16, 1), y int32 (n, 16, 16); the split is
    `load_digits`'s (1438 training, 359 validation images).
    """
    digits = load_digits(seed=seed, max_examples=max_examples)

    def up(x):
        return x.repeat(2, axis=1).repeat(2, axis=2)

    def mask(x):
        return (x[..., 0] > 0.5).astype("int32")

    x_train, x_val = up(digits.x_train), up(digits.x_val)
    return Data("segmentation", x_train, mask(x_train), x_val, mask(x_val), 2, "digits_masks")


def text_windows(tokens, seq_len):
    """Cuts a token array into non-overlapping (input, next-token target) windows.

    Returns:
      (x, y): int32 (n, seq_len) each, y[i, t] = x[i, t + 1] (the next token);
      n = (len(tokens) - 1) // seq_len.
    """
    tokens = np.asarray(tokens, dtype="int32")
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].reshape(n, seq_len)
    y = tokens[1: n * seq_len + 1].reshape(n, seq_len)
    return x, y


def _text_data(raw_bytes, seq_len, name, val_fraction=0.1):
    tokens = np.frombuffer(raw_bytes, dtype=np.uint8)
    # Validation is the end of the text, not a random sample of windows, so no
    # training window overlaps it.
    cut = int(len(tokens) * (1 - val_fraction))
    x_train, y_train = text_windows(tokens[:cut], seq_len)
    x_val, y_val = text_windows(tokens[cut:], seq_len)
    if not len(x_train) or not len(x_val):
        raise ValueError(f"{name}: {len(tokens)} bytes of text are too few for "
                         f"windows of seq_len={seq_len}.")
    return Data("text", x_train, y_train, x_val, y_val, TEXT_VOCAB, name)


def load_pydoc_topics(seed=0, max_examples=0, seq_len=DEFAULT_SEQ_LEN):
    """Python's own help texts (stdlib `pydoc_data.topics`) as byte-level LM data.

    The topics are joined in sorted order, UTF-8 encoded (vocabulary 256), and
    cut into windows of `seq_len` bytes; the last 10% of the text is the
    validation split. About 6,500 training windows of 64 bytes.
    """
    del seed  # the order of training windows is drawn by BatchOrder
    from pydoc_data import topics  # pylint: disable=import-outside-toplevel

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return _cap(_text_data(text.encode("utf-8"), seq_len, "pydoc_topics"), max_examples)


def _cap(data, max_examples):
    if max_examples:
        data.x_train, data.y_train = data.x_train[:max_examples], data.y_train[:max_examples]
        data.x_val, data.y_val = data.x_val[:max_examples], data.y_val[:max_examples]
    return data


BUILTIN = {"digits": load_digits, "digits_masks": load_digits_masks,
           "pydoc_topics": load_pydoc_topics}
# The `Data.kind` of each built-in data set, known without loading it (flag checks).
BUILTIN_KINDS = {"digits": "image", "digits_masks": "segmentation", "pydoc_topics": "text"}


# -- TensorFlow Datasets --------------------------------------------------------


def load_tfds(name, data_dir=None, max_examples=0, seq_len=DEFAULT_SEQ_LEN):
    """A TFDS data set that is already prepared under `data_dir`; never downloads.

    Image data sets (an Image feature and a ClassLabel, e.g. mnist, or the
    `supervised_keys`) become images in [0, 1] of their own size (variable-size
    images are resized to 32x32). Data sets with a Text feature and no image
    become byte-level text (like `pydoc_topics`). The validation split is
    "validation" or "test" if the data set has one, else the last 10% of "train".

    Args:
      name: a TFDS name, optionally with config and version ("mnist",
        "mnist:3.0.1"); a data set prepared in `data_dir` is found even when
        no builder class for it is registered in this process.
      data_dir: the TFDS data directory; None: TFDS's default
        (~/tensorflow_datasets or $TFDS_DATA_DIR).
      max_examples: if > 0, read at most this many examples of each split.

    Raises:
      ValueError: TFDS knows no such data set, or it is not prepared under
        `data_dir`, or it has neither image/label nor text features.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    where = data_dir or "TFDS's default data_dir"
    how = (f"Prepare it on a machine with network access (`tfds build {name} "
           f"--data_dir=DIR`, or tfds.builder({name!r}, data_dir=DIR)"
           f".download_and_prepare()), copy DIR here and pass --data_dir=DIR.")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"TensorFlow Datasets has no data set {name!r}: it is neither a registered "
            f"TFDS name nor prepared under {where}. {how}") from None
    if not builder.is_prepared():
        raise ValueError(
            f"TFDS data set {name!r} is not prepared under {where} (launch.train "
            f"never downloads). {how}")
    info = builder.info
    splits = set(info.splits.keys())
    if "train" not in splits:
        raise ValueError(f"TFDS data set {name!r} has no 'train' split (it has {sorted(splits)}).")
    val_split = next((s for s in ("validation", "test") if s in splits), None)
    train_split = "train" if val_split else "train[:90%]"
    val_split = val_split or "train[90%:]"

    features = info.features
    image_key, label_key = _image_label_keys(info)
    if image_key is not None:
        image_feature = features[image_key]
        shape = tuple(image_feature.shape)
        size = None if None in shape[:2] else shape[:2]

        def to_float(example):
            image = example[image_key]
            scale = 255.0 if image.dtype == tf.uint8 else 1.0
            image = tf.cast(image, tf.float32) / scale
            if size is None:
                image = tf.image.resize(image, (32, 32))
            return image, tf.cast(example[label_key], tf.int32)

        read = lambda split: _read(builder, split, to_float, max_examples)  # noqa: E731
        (x_train, y_train), (x_val, y_val) = read(train_split), read(val_split)
        return Data("image", x_train, y_train, x_val, y_val,
                    int(features[label_key].num_classes), f"tfds:{name}")

    text_key = next((k for k, f in features.items() if isinstance(f, tfds.features.Text)), None)
    if text_key is None:
        raise ValueError(
            f"TFDS data set {name!r} has neither an image and a class label nor a text "
            f"feature (features: {sorted(features.keys())}); launch.train cannot use it.")

    def text_bytes(split):
        ds = builder.as_dataset(split=split, shuffle_files=False)
        if max_examples:
            ds = ds.take(max_examples)
        return b"\n\n".join(bytes(ex[text_key]) for ex in tfds.as_numpy(ds))

    x_train, y_train = text_windows(np.frombuffer(text_bytes(train_split), np.uint8), seq_len)
    x_val, y_val = text_windows(np.frombuffer(text_bytes(val_split), np.uint8), seq_len)
    if not len(x_train) or not len(x_val):
        raise ValueError(f"TFDS data set {name!r}: too little text for seq_len={seq_len}.")
    return Data("text", x_train, y_train, x_val, y_val, TEXT_VOCAB, f"tfds:{name}")


def _image_label_keys(info):
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    features = info.features
    keys = info.supervised_keys
    if keys and len(keys) == 2 and all(isinstance(k, str) for k in keys):
        x_key, y_key = keys
        if (isinstance(features[x_key], tfds.features.Image)
                and isinstance(features[y_key], tfds.features.ClassLabel)):
            return x_key, y_key
    images = [k for k, f in features.items() if isinstance(f, tfds.features.Image)]
    labels = [k for k, f in features.items() if isinstance(f, tfds.features.ClassLabel)]
    if images and labels:
        return ("image" if "image" in images else images[0],
                "label" if "label" in labels else labels[0])
    return None, None


def _read(builder, split, fn, max_examples):
    import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

    ds = builder.as_dataset(split=split, shuffle_files=False)
    if max_examples:
        ds = ds.take(max_examples)
    xs, ys = [], []
    for x, y in tfds.as_numpy(ds.map(fn).batch(1024)):
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ValueError(f"TFDS split {split!r} of {builder.name!r} is empty.")
    return np.concatenate(xs), np.concatenate(ys)


def load(name, seed=0, data_dir=None, max_examples=0):
    """Loads a built-in data set by name, or `tfds:NAME` through `load_tfds`.

    Raises:
      ValueError: an unknown name (the message lists the valid choices).
    """
    if name.startswith(TFDS_PREFIX):
        tfds_name = name[len(TFDS_PREFIX):]
        if not tfds_name:
            raise ValueError("dataset 'tfds:' needs a TFDS name, e.g. 'tfds:mnist'.")
        return load_tfds(tfds_name, data_dir=data_dir, max_examples=max_examples)
    if name not in BUILTIN:
        raise ValueError(
            f"Unknown dataset {name!r}; valid choices: {', '.join(sorted(BUILTIN))}, "
            f"or {TFDS_PREFIX}NAME for a TensorFlow Datasets data set prepared under "
            f"--data_dir.")
    return BUILTIN[name](seed=seed, max_examples=max_examples)


# -- per-model views ------------------------------------------------------------


def as_flat_8x8(images):
    """Images (n, H, W, C) -> (n, 64): grey (channel mean), area-resized to 8x8.

    What the digits MLP takes; 8x8x1 images are only flattened.
    """
    images = np.asarray(images, dtype="float32")
    if images.shape[1:3] != (8, 8):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        images = tf.image.resize(images, (8, 8), method="area").numpy()
    if images.shape[-1] != 1:
        images = images.mean(axis=-1, keepdims=True)
    return images.reshape(len(images), 64)


# -- batch order ----------------------------------------------------------------


class BatchOrder:
    """The rows of the batch of every global step: a pure function of the step.

    The data is drawn in passes; pass p visits the rows in the order
    `np.random.default_rng([seed, p]).permutation(n)`, in batches of
    `batch_size` (the last batch of a pass may be smaller; with
    `whole_batches`, the rows that would fill it are left out of that pass,
    for a program that takes one static batch size). Step s (0-based)
    takes batch `s % batches_per_pass` of pass `s // batches_per_pass`. So a run
    resumed at step s draws exactly the batches the uninterrupted run drew.

    >>> order = BatchOrder(num_rows=10, batch_size=4, seed=0)
    >>> order.batches_per_pass, [len(order.rows(s)) for s in range(4)]
    (3, [4, 4, 2, 4])
    """

    def __init__(self, num_rows, batch_size, seed=0, whole_batches=False):
        if num_rows < (batch_size if whole_batches else 1):
            raise ValueError(f"BatchOrder needs at least {batch_size if whole_batches else 1} "
                             f"row(s), got {num_rows}.")
        self.num_rows = int(num_rows)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.whole_batches = bool(whole_batches)
        self.batches_per_pass = (self.num_rows // self.batch_size if whole_batches
                                 else math.ceil(self.num_rows / self.batch_size))
        self._cached_pass = None
        self._permutation = None

    def _pass_permutation(self, p):
        if p != self._cached_pass:
            self._permutation = np.random.default_rng([self.seed, p]).permutation(self.num_rows)
            self._cached_pass = p
        return self._permutation

    def rows(self, step):
        """Indices (into the training arrays) of the rows of step `step`."""
        p, b = divmod(int(step), self.batches_per_pass)
        return self._pass_permutation(p)[b * self.batch_size:(b + 1) * self.batch_size]

    def num_rows_of(self, step):
        p, b = divmod(int(step), self.batches_per_pass)
        del p
        return min(self.batch_size, self.num_rows - b * self.batch_size)

    def dataset(self, x, y, start, stop):
        """A `tf.data.Dataset` of the (x, y) batches of steps start, ..., stop - 1."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        def batches():
            for step in range(start, stop):
                rows = self.rows(step)
                yield x[rows], y[rows]

        rows = self.batch_size if self.whole_batches else None
        spec = lambda a: tf.TensorSpec((rows,) + a.shape[1:], tf.as_dtype(a.dtype))  # noqa: E731
        return tf.data.Dataset.from_generator(batches, output_signature=(spec(x), spec(y)))
