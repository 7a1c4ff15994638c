# cmake -DIN=file -DOUT=header -DNAME=symbol -P embed.cmake: the bytes of IN as a C array
# (16-byte aligned, const) named NAME in OUT. For the refit gather kernel's fatbin.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
if(n EQUAL 0)
  message(FATAL_ERROR "embed.cmake: ${IN} is empty")
endif()
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "((0x..,){16})" "\\1\n" bytes "${bytes}")
file(WRITE "${OUT}" "/* Generated from ${IN} by embed.cmake: do not edit. */\n"
     "#include <stdalign.h>\nstatic const alignas(16) unsigned char ${NAME}[] = {\n${bytes}\n};\n")
