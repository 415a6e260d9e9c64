"""torchvision ResNet50 at the tutorial's size: batch 120 of 3×128×128 images.

A model file for ``autosplit``: it defines ``build_model()`` and ``example_inputs(batch_size)``.
Run it directly to partition ResNet50 over 2 devices and print the plan.
"""

import torch
import torchvision

BATCH_SIZE = 120
IMAGE_SIZE = 128
NUM_CLASSES = 1000

# The tutorial's hand-written split: seq1 = conv1 … layer2 on one GPU, layer3 … fc on the other,
# micro-batches of 20. `autosplit plan` and `autosplit compare` show autosplit's plan beside it.
MANUAL_SPLIT = ["layer3"]
MANUAL_SPLIT_SIZE = 20


def build_model() -> torch.nn.Module:
    """A freshly initialised ResNet50 (no weights are downloaded)."""
    return torchvision.models.resnet50(num_classes=NUM_CLASSES)


def example_inputs(batch_size: int = BATCH_SIZE) -> tuple[torch.Tensor, ...]:
    """One batch of random images, as in the tutorial."""
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE),)


if __name__ == "__main__":
    import autosplit

    pm = autosplit.partition(build_model(), example_inputs(), gpus=2)
    print(pm.plan)
    pm.plan.save("plan.json")
    print("wrote plan.json")
