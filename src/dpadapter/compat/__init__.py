"""Import-time fixes for third-party packages (layer 0): torchvision on a CPU-only torch.

Installed from `dpadapter/__init__.py` and the venv's `.pth`, before anything imports
torchvision, so it may import only the standard library and the packages it patches.
"""
