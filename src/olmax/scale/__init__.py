"""Scale before hardware: run costs (`plan`) and ahead-of-time compiles for TPU and GPU targets (`compile`)."""
