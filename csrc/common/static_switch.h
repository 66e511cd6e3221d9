// Turning runtime choices into template parameters, one lambda instantiation per case.
#pragma once

#define FLA_CULA_BOOL_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                             \
    if (COND) {                                     \
      constexpr static bool CONST_NAME = true;      \
      return __VA_ARGS__();                         \
    } else {                                        \
      constexpr static bool CONST_NAME = false;     \
      return __VA_ARGS__();                         \
    }                                               \
  }()
