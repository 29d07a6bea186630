"""Training drafters by self-distillation (``spec-hal train-head``, `command`), written in the
layouts their authors publish: an EAGLE-3 head (`eagle_train`, SafeAILab's layout), a DSpark or DFlash
block drafter (`dspark_train`, in DeepSpec's and z-lab's layouts).
The prompt set and the recorded features (`data`, `block_data`), the block drafter's confidence
head refitted on held-back sequences (`confidence`), the loss curves (`curves`)."""
