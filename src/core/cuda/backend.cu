#include "../cuda_backend.h"
