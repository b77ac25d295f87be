"""The packed forward pass: batch layout, attention kernels, layers, model families, weight loading."""
